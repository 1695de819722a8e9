"""Model shapes for the memory ledger: built-in presets, a local config.json, or the built-in tiny model.

What this is: ``ModelShape`` (the handful of numbers memory and FLOPs depend
on: layers, widths, heads, vocabulary, tied embeddings) and ``resolve_shape``,
which reads them without loading any weights. Presets use the published
Qwen2.5 dense shapes (config.json of Qwen/Qwen2.5-{0.5B,1.5B,7B,32B,72B}), the
family the recipes name by size.

What this is not: a model loader (rlctl.models.load) or the ledger itself
(rlctl.planning.memory). Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from rlctl.contracts.errors import ConfigError, ModelError


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Shape of a dense decoder-only transformer (Llama / Qwen2 family).

    >>> ModelShape(name="t", num_layers=2, hidden_size=32, intermediate_size=64, num_heads=2,
    ...            num_kv_heads=1, head_dim=16, vocab_size=99, tie_embeddings=True).num_params
    21760
    """

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    qkv_bias: bool = False
    source: str = "preset"

    @property
    def kv_dim(self) -> int:
        """Width of one token's keys (= of its values): H_kv x d."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.kv_dim, self.intermediate_size
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * i + 2 * h  # + two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params + self.hidden_size

    @property
    def flops_per_token(self) -> float:
        """Forward FLOPs per token from the weights alone (2 x matmul parameters, lm_head included)."""
        return 2.0 * (self.num_layers * self.layer_params + self.vocab_size * self.hidden_size)


def _qwen25(name: str, layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int,
            tie: bool) -> ModelShape:
    return ModelShape(name=name, num_layers=layers, hidden_size=hidden, intermediate_size=inter, num_heads=heads,
                      num_kv_heads=kv, head_dim=hidden // heads, vocab_size=vocab, tie_embeddings=tie,
                      qkv_bias=True, source="preset (Qwen2.5 shape)")


PRESETS: dict[str, ModelShape] = {
    "0.5b": _qwen25("0.5b", 24, 896, 4864, 14, 2, 151936, True),
    "1.5b": _qwen25("1.5b", 28, 1536, 8960, 12, 2, 151936, True),
    "7b": _qwen25("7b", 28, 3584, 18944, 28, 4, 152064, False),
    "32b": _qwen25("32b", 64, 5120, 27648, 40, 8, 152064, False),
    "72b": _qwen25("72b", 80, 8192, 29568, 64, 8, 152064, False),
}


def from_hf_config(cfg: Mapping[str, Any], name: str, source: str) -> ModelShape:
    """Shape from a Hugging Face config.json dict (Llama, Qwen2, Mistral and kin)."""
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelShape(
            name=name, num_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), vocab_size=int(cfg["vocab_size"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")), source=source,
        )
    except (KeyError, TypeError, ValueError) as err:
        hint = "the ledger reads Llama/Qwen2-style config.json files; or pass --shape 7b (a preset)"
        raise ModelError(f"{source} lacks a dense-decoder field the ledger needs ({err})", hint) from None


def resolve_shape(spec: str) -> ModelShape:
    """A preset name ('7b'), a config.json file, or a model directory holding one."""
    key = spec.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"unknown model shape {spec!r}",
                          f"use a preset ({', '.join(PRESETS)}), a config.json file, or a model directory")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelError(f"{path} is not valid JSON: {err}", "pass the model's config.json") from None
    return from_hf_config(cfg, name=path.parent.name or str(path), source=str(path))


def builtin_shape(model: Any, vocab_size: int) -> ModelShape:
    """Shape of the built-in tiny model of a ``ModelConfig`` (Llama, tied embeddings, no biases)."""
    return ModelShape(name="builtin:tiny", num_layers=model.num_layers, hidden_size=model.hidden_size,
                      intermediate_size=model.intermediate_size, num_heads=model.num_heads,
                      num_kv_heads=model.num_kv_heads, head_dim=model.hidden_size // model.num_heads,
                      vocab_size=vocab_size, tie_embeddings=True, qkv_bias=False, source="config (built-in)")


def with_name(shape: ModelShape, name: str) -> ModelShape:
    return replace(shape, name=name)
