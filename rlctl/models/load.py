"""Load a policy from a local Hugging Face directory, or build the tiny built-in one.

What this is: the only place model directories are opened. Every failure is a
ModelError naming the directory and what is missing.

What this is not: downloading. ``HF_HUB_OFFLINE`` semantics are enforced by
passing ``local_files_only=True`` everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlctl.config.models import ModelConfig
from rlctl.contracts.errors import ModelError


def build_tiny(config: ModelConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int, seed: int) -> Any:
    """A small Llama-architecture causal LM, initialised from ``seed``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, max_position_embeddings=256,
        pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id, tie_word_embeddings=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg)


def check_model_dir(path: str | Path) -> Path:
    """Validate that ``path`` is a loadable causal-LM directory with a tokenizer."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ModelError(f"model directory not found: {root}",
                         "set model.path to a local Hugging Face model directory, or 'builtin:tiny'")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{root} has no config.json, so it is not a Hugging Face model directory",
                         "point model.path at the directory that save_pretrained wrote")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelError(f"{cfg_path} is not valid JSON: {err}", "restore the file from the model's source") from None
    if not any((root / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json",
                                              "pytorch_model.bin", "pytorch_model.bin.index.json")):
        raise ModelError(f"{root} has a config.json but no weights (model.safetensors)", "copy the weight files too")
    if not any((root / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelError(f"{root} has no tokenizer files", "save the tokenizer into the same directory")
    if "model_type" not in cfg:
        raise ModelError(f"{cfg_path} has no model_type", "use a directory written by transformers' save_pretrained")
    return root


def eos_token_ids(model_dir: str | Path) -> set[int]:
    """The end-of-sequence token ids a model directory declares (config.json and generation_config.json): what a
    remote engine's finish reason is read against."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            value = json.loads((Path(model_dir) / name).read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError):
            continue
        ids.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    return ids


def load_policy(path: str | Path, dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer) from a checked local directory; weights load as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = check_model_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            root, local_files_only=True, dtype=getattr(torch, dtype), use_safetensors=True
        )
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"cannot load the model in {root}: {err}", "check that it is a causal LM saved by transformers") from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.eval()
    return model, tokenizer
