"""Batched autoregressive sampling with a KV cache on torch.

What this is: one function that expands each prompt G times, left-pads, runs
one prefill and then one cached decode step per new token for the whole batch,
and records each sampled token's log-probability under the distribution it
was actually drawn from (``rlctl.algo.sampling``: temperature, top-k, top-p).

What this is not: continuous batching or paged attention (serving engines do
that; see the sglang plugin).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlctl import SamplingConfig, TerminalReason
from rlctl.algo.sampling import process_logits


@dataclass(frozen=True, slots=True)
class Sampled:
    tokens: list[list[int]]  # per row, response tokens (eos included when emitted)
    logprobs: list[list[float]]
    reasons: list[TerminalReason]


@torch.no_grad()
def sample(model: Any, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, eos_id: int,
           pad_id: int, generator: torch.Generator, stop_check: Any = None) -> Sampled:
    """Sample one response per row of ``prompts`` (callers repeat a prompt G times)."""
    n = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [N, Lp]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache, logits = out.cache, out.logits[:, -1, :]  # [N, V]
    next_pos = positions[:, -1:] + 1  # [N, 1]
    tokens = torch.full((n, sampling.max_tokens), pad_id, dtype=torch.long)
    logps = torch.zeros((n, sampling.max_tokens), dtype=torch.float32)
    lengths = torch.full((n,), sampling.max_tokens, dtype=torch.long)
    reasons = [TerminalReason.LENGTH] * n
    done = torch.zeros(n, dtype=torch.bool)
    for t in range(sampling.max_tokens):
        tok, lp = _draw(logits, sampling, generator)  # [N], [N]
        tokens[:, t] = torch.where(done, pad_id, tok)
        logps[:, t] = torch.where(done, 0.0, lp)
        newly = (~done) & (tok == eos_id)
        for i in newly.nonzero().flatten().tolist():
            lengths[i], reasons[i] = t + 1, TerminalReason.EOS
        done |= newly
        if stop_check is not None:
            for i in (~done).nonzero().flatten().tolist():
                if stop_check(tokens[i, : t + 1].tolist()):
                    lengths[i], reasons[i] = t + 1, TerminalReason.STOP
                    done[i] = True
        if bool(done.all()) or t + 1 == sampling.max_tokens:
            break
        mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
        out = model(input_ids=tokens[:, t:t + 1], attention_mask=mask, position_ids=next_pos,
                    cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1, :]
        next_pos = next_pos + 1
    lens = lengths.tolist()
    return Sampled(
        tokens=[tokens[i, : lens[i]].tolist() for i in range(n)],
        logprobs=[logps[i, : lens[i]].tolist() for i in range(n)],
        reasons=reasons,
    )


def _draw(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator):
    if sampling.greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
        tok = logp.argmax(-1)
    else:
        logp = torch.log_softmax(process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p), dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
