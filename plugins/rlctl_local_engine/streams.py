"""Per-row random streams of the slot scheduler and the draw that uses them (slots.py).

A row's draws come from its own stream: ``uniforms`` hashes (the row's 64-bit key, token index) with murmur3's
finalizer into a float64 in [0, 1), and ``_draw`` turns it into a token by inverse CDF over the processed
distribution, so a row draws the same tokens whichever slots and steps it lands in. ``row_key`` names a row's
stream from the engine seed and what names the row (call, request, sample index).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from rlctl import SamplingConfig
from rlctl.kit.algo import process_logits

_MASK32 = 0xFFFFFFFF


def row_key(seed: int, *parts: Any) -> int:
    """A 64-bit stream key from the engine seed and what names a row (call, request, sample index)."""
    import hashlib

    text = repr((int(seed), *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def uniforms(keys: Sequence[int], steps: int) -> torch.Tensor:
    """``[len(keys), steps]`` float64 in [0, 1): row r's draw for token t, a hash of (keys[r], t) with 53 bits."""
    k = torch.tensor([[key & _MASK32, (key >> 32) & _MASK32] for key in keys], dtype=torch.long).view(-1, 2, 1)
    t = torch.arange(steps, dtype=torch.long)[None]
    a = _fmix(((t * 0x9E3779B9) & _MASK32) ^ k[:, 0])
    a = _fmix(a ^ k[:, 1])
    b = _fmix((a + 0x68E31DA4) & _MASK32 ^ k[:, 0])
    return ((a >> 5) * 67108864 + (b >> 6)).double() / 9007199254740992.0


@functools.lru_cache(maxsize=256)
def _distribution(sampling: SamplingConfig) -> SamplingConfig:
    """What a draw depends on (temperature, top-p, top-k): rows that differ only in max tokens or stop strings
    (every serve request names its own max_new_tokens) share one draw per step."""
    return SamplingConfig(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, max_tokens=1)


def _draw(logits: torch.Tensor, sampling: SamplingConfig, u: torch.Tensor | None):
    """Per-row draws: greedy argmax, or inverse CDF of the processed distribution at the row's own uniform."""
    if sampling.greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
        tok = logp.argmax(-1)
    else:
        logp = torch.log_softmax(process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p), dim=-1)
        cdf = logp.double().exp().cumsum(-1)  # [n, V]
        tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


