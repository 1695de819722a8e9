"""Per-token log-probs with each distinct prompt run through the model once (prefill sharing).

What this is: ``prefix_shared_logprobs``, the torch learner's forward when the
G responses of a GRPO group share one prompt: the prompt's KV cache is built
once and reused by every response (gradients flow back through it into the
one prompt forward). Same maths as the plain forward, fewer FLOPs.

What this is not: the plain forward (TorchLearner._logprobs), which the
learner takes when no prompt is shared.
"""

from __future__ import annotations

from typing import Any

import torch

from rlctl.algo import entropy_from_logits, process_logits, token_logprobs
from rlctl.contracts.batch import TrainBatch
from rlctl.models.compat import kv_cache_name


def prefix_shared_logprobs(model: Any, batch: TrainBatch, with_entropy: bool):
    """Like ``TorchLearner._logprobs`` but each distinct prompt runs through the model once.

    The G responses of a prompt share its KV cache (gradients flow back through
    it into the one prompt forward), so a GRPO micro-batch costs about one
    prompt forward per group instead of G. Returns None when nothing is shared
    (or a row has no response), and the caller takes the plain path.

    The shared prefix of a row is everything before its first trained token:
    the prompt, plus the opening observation of an episode whose environment
    speaks first (shared when the G episodes got the same one). Everything
    after it -- an episode's later environment turns included -- is forwarded
    per row, exactly as the plain path does, so log-probs agree on every
    position and the action mask alone decides what is trained
    (tests/unit/test_episode_masks.py).
    """
    ids, mask, act = batch.input_ids, batch.attention_mask, batch.action_mask  # [n, T]
    n, width = ids.shape
    if bool((act.sum(-1) == 0).any()):
        return None
    starts = (act > 0).to(torch.int8).argmax(-1)  # [n] prompt length = first trained position
    ends = mask.sum(-1)  # [n]
    keys = [tuple(ids[i, : int(starts[i])].tolist()) for i in range(n)]
    index: dict[tuple[int, ...], int] = {}
    rows = torch.tensor([index.setdefault(k, len(index)) for k in keys])  # [n] -> unique prompt
    if len(index) == n:
        return None
    prompts = list(index)
    plen = max(len(p) for p in prompts)
    p_ids = torch.zeros((len(prompts), plen), dtype=torch.long)
    p_mask = torch.zeros((len(prompts), plen), dtype=torch.long)
    for u, p in enumerate(prompts):
        p_ids[u, plen - len(p):] = torch.tensor(p)
        p_mask[u, plen - len(p):] = 1
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)  # [u, Lp]
    out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1][rows]  # [n, V]: predicts each row's first response token
    kv = kv_cache_name()  # transformers renamed past_key_values to cache (5.17 -> 5.24)
    cache = getattr(out, kv)
    cache.batch_select_indices(rows)
    rlen = ends - starts  # [n]
    width_r = int(rlen.max())
    offsets = torch.arange(width_r)  # [R]
    valid = offsets[None, :] < rlen[:, None]  # [n, R]
    gather_at = (starts[:, None] + offsets[None, :]).clamp(max=width - 1)  # [n, R]
    resp = torch.where(valid, ids.gather(1, gather_at), 0)  # [n, R]
    logits = first[:, None]  # [n, 1, V]
    if width_r > 1:
        full_mask = torch.cat([p_mask[rows], valid[:, :-1].long()], dim=1)  # [n, Lp + R - 1]
        positions = p_pos[rows, -1:] + 1 + offsets[None, : width_r - 1]  # [n, R-1]
        more = model(input_ids=resp[:, :-1], attention_mask=full_mask, position_ids=positions, use_cache=True,
                     **{kv: cache}).logits  # [n, R-1, V]
        logits = torch.cat([logits, more], dim=1)  # [n, R, V]
    s = batch.sampling
    lp = torch.where(valid, token_logprobs(logits, resp, s.temperature, s.top_k, s.top_p), 0.0)  # [n, R]
    place = starts[:, None] + offsets[None, :]  # [n, R], distinct per row, < T + R
    logp = torch.zeros((n, width + width_r), dtype=lp.dtype).scatter(1, place, lp)[:, :width]  # [n, T]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            shaped = logits if s.greedy else process_logits(logits.detach(), s.temperature, s.top_k, s.top_p)
            ent = torch.where(valid, entropy_from_logits(shaped), 0.0)  # [n, R]
            entropy = torch.zeros((n, width + width_r), dtype=ent.dtype).scatter(1, place, ent)[:, :width]
    return logp, entropy


def shared_token_counts(batch: TrainBatch) -> tuple[float, float]:
    """(needed, computed) tokens of ``prefix_shared_logprobs`` on ``batch``: each distinct prompt once plus every
    response token but the last; computed adds the padding of the prompts to the longest and of the responses
    to the longest (``rlctl profile``'s padding waste)."""
    act, mask, ids = batch.action_mask, batch.attention_mask, batch.input_ids
    starts = (act > 0).to(torch.int8).argmax(-1).tolist()  # [n]
    ends = mask.sum(-1).tolist()
    prompts = {tuple(ids[i, :s].tolist()) for i, s in enumerate(starts)}
    resp = [e - s for s, e in zip(starts, ends)]
    plen, width_r = max(len(p) for p in prompts), max(resp)
    needed = sum(len(p) for p in prompts) + sum(r - 1 for r in resp)
    return float(needed), float(len(prompts) * plen + len(resp) * (width_r - 1))


def distinct_prompt_tokens(batch: TrainBatch) -> float:
    """Tokens of ``batch`` with each distinct prompt counted once (a packed row with shared prompts)."""
    act, mask, ids = batch.action_mask, batch.attention_mask, batch.input_ids
    starts = (act > 0).to(torch.int8).argmax(-1).tolist()  # [n]
    prompts = {tuple(ids[i, :s].tolist()) for i, s in enumerate(starts)}
    return float(sum(len(p) for p in prompts) + int(mask.sum()) - sum(starts))
