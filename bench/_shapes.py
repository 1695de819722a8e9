"""Random-weight Qwen2 model directories built from a config (nothing downloaded), for the GPU checks and the
TRL step-time bench.

Shapes: ``tiny`` and ``small`` (CPU sizes) and ``qwen2-0.5b`` (Qwen2-0.5B's layout: hidden 896, 24 layers,
14 query / 2 KV heads, MLP 4864, tied embeddings). Every directory carries rlctl's built-in character
tokenizer; ``vocab`` sizes the embedding: ``char`` = that tokenizer's 99 entries, ``qwen`` = Qwen2's 151,936
rows (the real 0.5B parameter count, 494M). With ``qwen`` a random model samples ids the character tokenizer
cannot decode (they decode to nothing, so every reward is 0): fine for timing and memory, not for learning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

QWEN2_VOCAB = 151936

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256),
    "small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=512),
    "qwen2-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, rope_theta=1_000_000.0),
}


def build_model_dir(shape: str, out: Path, vocab: str = "char", seed: int = 0) -> tuple[Path, int]:
    """Write a random-weight Qwen2 causal LM of ``shape`` and the character tokenizer to ``out`` (fp32
    safetensors); returns the directory and its parameter count. Rebuilt only when missing."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlctl.models.tokenizer import build_char_tokenizer

    if shape not in SHAPES:
        raise SystemExit(f"error: unknown --shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if vocab not in ("char", "qwen"):
        raise SystemExit(f"error: unknown --vocab {vocab!r}; choose char (the built-in tokenizer's) or qwen")
    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok) if vocab == "char" else QWEN2_VOCAB, max_position_embeddings=4096,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=True, **SHAPES[shape])
    out = Path(out) / f"{shape}-{vocab}-seed{seed}"
    if not (out / "config.json").is_file():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
        model.save_pretrained(out)
        tok.save_pretrained(out)
    with torch.device("meta"):  # count without allocating a second copy
        n = sum(p.numel() for p in Qwen2ForCausalLM(cfg).parameters())
    return out, n
