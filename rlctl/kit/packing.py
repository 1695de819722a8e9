"""Packed learner micro-batches: whole sequences laid end to end under a token budget, no padding.

What this is: ``micro_batch_rows`` / ``pack_rows`` (which rows of a batch
share a micro-batch when ``train.micro_batch_tokens`` is set),
``packed_forward`` (the forward of one such micro-batch) with
``unpack_shifted`` (its per-token outputs back in the padded layout), and
``packed_logprobs`` on top of them; the policy learner (rlctl.kit.TorchLearner,
so also the FSDP2 and DeepSpeed ranks) and the torch critic (values read from
the packed decoder's hidden states) both use them. A packed micro-batch is one row of ``S`` tokens: the
real tokens (prompt + response) of each sequence, one after another, with
position ids restarting at 0 for every sequence, so no token attends across
a sequence boundary. Attention: a model on sdpa or eager attention is
switched (``segment_attention``) to an implementation that runs causal sdpa
on each sequence's slice of the packed row, so attention costs the sum of
L_i^2 and no mask is built; any other implementation (flash attention) gets
the sequence boundaries as ``cu_seq_lens`` and from the position ids, which
transformers reads as packed sequences (``find_packed_sequence_indices``:
the block-diagonal causal mask). On CPU (transformers 5.24, Llama and Qwen2,
sdpa and eager) both give the padded path's logits (bit for bit in float64). The
per-token log-probs (and entropy, and the critic's values) are put back in the padded ``[n, T]``
layout of the micro-batch, so the loss, its normalisation and every metric
are computed by exactly the same code as the padded path; only the forward
differs (no FLOPs on padding, and no micro-batch padded to the batch's
longest sequence).

What this is not: prefix-cache prompt sharing on the padded path
(rlctl.kit.prefill; here a shared prompt is laid out once in the packed row,
``shared_layout``, for the policy only) or a varlen attention
kernel: the per-sequence loop is Python, one sdpa call per sequence and
layer.
"""

from __future__ import annotations

from typing import Any

import torch

from rlctl.algo import entropy_from_logits, process_logits, token_logprobs
from rlctl.contracts.batch import TrainBatch

SEGMENTS = "rlctl_segments"  # the attention implementation's registered name


def segment_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, **kwargs: Any):
    """sdpa attention over packed sequences: causal sdpa on each ``[cu[i], cu[i+1])`` slice of the row.

    Without ``cu_seq_lens_q`` in ``kwargs`` it is plain sdpa with the mask it is given.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    groups = kwargs.pop("rlctl_prompt_groups", None)
    for key_name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(key_name, None)
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    if groups is not None:
        return _group_attention(module, query, key, value, groups, sdpa_attention_forward, kwargs), None
    bounds = cu.tolist()
    outs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                   is_causal=True, **kwargs)[0] for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=1), None  # [1, S, heads, head_dim], as sdpa_attention_forward returns


def _group_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     groups: list[tuple[int, int, list[tuple[int, int, torch.Tensor]]]], sdpa: Any,
                     kwargs: dict) -> torch.Tensor:
    """Attention of a packed row laid out as prompt, then its responses (``shared_layout``): the prompt is
    causal on itself, each response attends to the whole prompt and causally to itself, in flat order."""
    outs = []
    for a, p, responses in groups:
        outs.append(sdpa(module, query[:, :, a:a + p], key[:, :, a:a + p], value[:, :, a:a + p], None,
                         is_causal=True, **kwargs)[0])
        for b, e, seen in responses:  # seen: [1, 1, e - b, p + e - b], the whole prompt and causal on itself
            k = torch.cat([key[:, :, a:a + p], key[:, :, b:e]], dim=2)
            v = torch.cat([value[:, :, a:a + p], value[:, :, b:e]], dim=2)
            outs.append(sdpa(module, query[:, :, b:e], k, v, seen, is_causal=False, **kwargs)[0])
    return torch.cat(outs, dim=1)


def use_segment_attention(model: Any) -> None:
    """Switch a model on sdpa or eager attention to ``segment_attention`` (others keep theirs)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model is None or model.config._attn_implementation not in ("sdpa", "eager"):
        return
    AttentionInterface.register(SEGMENTS, segment_attention)
    AttentionMaskInterface.register(SEGMENTS, sdpa_mask)  # a forward without cu_seq_lens stays plain sdpa
    model.set_attn_implementation(SEGMENTS)


def pack_rows(lengths: list[int], budget: int, max_rows: int) -> list[range]:
    """Consecutive row ranges of at most ``budget`` tokens and ``max_rows`` rows each (next fit, in row order).

    Rows keep their order (a micro-batch is a contiguous slice of the batch,
    as in the padded path). A row longer than ``budget`` gets a micro-batch
    of its own: a sequence is never split.
    """
    out: list[range] = []
    start, used = 0, 0
    for i, n in enumerate(lengths):
        if i > start and (used + n > budget or i - start >= max_rows):
            out.append(range(start, i))
            start, used = i, 0
        used += n
    if lengths:
        out.append(range(start, len(lengths)))
    return out


def packed_inputs(mask: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The packed row of a right-padded micro-batch: ids [1, S], position ids [1, S] (restarting at 0 per
    sequence), and the flat index [n, T] of each (row, position) in it (-1 on padding)."""
    lengths = mask.sum(-1)  # [n]
    width = mask.shape[1]
    real = mask > 0  # [n, T]; right padding: the real tokens are 0 .. L-1
    flat_ids = ids[real][None]  # [1, S]
    offsets = torch.cumsum(lengths, 0) - lengths  # [n] first flat index of each row
    steps = torch.arange(width, device=ids.device)
    index = torch.where(real, offsets[:, None] + steps[None], -1)  # [n, T]
    positions = steps[None].expand_as(real)[real][None]  # [1, S]
    return flat_ids, positions, index


def packed_forward(model: Any, batch: TrainBatch) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Forward a right-padded micro-batch as one packed row: the model's output, the flat ids, the flat index.

    The output is ``[1, S, ...]``, the flat ids [1, S], the flat index [n, T]
    holds each (row, position)'s place in the row (-1 on padding;
    ``unpack_shifted`` reads it). ``model`` is a causal LM or its decoder (the
    critic's backbone): both take the sequence bounds as ``cu_seq_lens`` and
    restarting position ids, with no attention mask and no cache.
    """
    ids, mask = batch.input_ids, batch.attention_mask  # [n, T]
    flat_ids, positions, index = packed_inputs(mask, ids)
    lengths = mask.sum(-1)
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)  # [n + 1] sequence bounds
    top = int(lengths.max())
    out = model(input_ids=flat_ids, position_ids=positions, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=top, max_length_k=top)
    return out, flat_ids, index


def unpack_shifted(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A packed row's per-token outputs in the micro-batch's padded [n, T] layout, each on the token it is about.

    ``flat`` [S - 1]: entry j is computed at flat position j about flat token
    j + 1 (its log-prob, or the value of the state before it). Token t of a row
    gets the entry of the row's position t - 1, as the padded path's
    ``pad(x[:, :-1], (1, 0))`` does; 0 on each row's first token (predicted
    from the previous row's last one: not this row's) and on padding.
    """
    shifted = torch.nn.functional.pad(flat, (1, 0))  # [S]: flat token j's entry, computed at j - 1
    valid = index > 0  # [n, T]
    valid[:, 0] = False
    return torch.where(valid, shifted[index.clamp(min=0)], torch.zeros((), dtype=flat.dtype, device=flat.device))


def packed_logprobs(model: Any, batch: TrainBatch, with_entropy: bool, share_prompts: bool = False):
    """``TorchLearner._logprobs`` of a micro-batch forwarded packed: the same ``[n, T]`` tensors, 0 on padding.

    Token t of a row is predicted at flat position t - 1 of the same row; the
    first token of every row has no prediction (0, as in the padded path).
    With ``share_prompts`` on a model switched to ``segment_attention``, rows
    that share a prompt share its forward (``shared_packed_logprobs``).
    """
    if share_prompts and model.config._attn_implementation == SEGMENTS:
        layout = shared_layout(batch)
        if layout is not None:
            return shared_packed_logprobs(model, batch, with_entropy, layout)
    out, flat_ids, index = packed_forward(model, batch)
    logits = out.logits[0, :-1]  # [S-1, V]
    s = batch.sampling
    logp = unpack_shifted(token_logprobs(logits[None], flat_ids[:, 1:], s.temperature, s.top_k, s.top_p)[0], index)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            shaped = logits if s.greedy else process_logits(logits.detach(), s.temperature, s.top_k, s.top_p)
            entropy = unpack_shifted(entropy_from_logits(shaped), index)
    return logp, entropy


def micro_batch_rows(lengths: list[int], size: int, budget: int | None) -> list[range]:
    """The micro-batches of rows with these real-token ``lengths``, as consecutive row ranges: ``size`` rows each
    (padded micro-batches), or packed under ``budget`` tokens and at most ``size`` rows (``pack_rows``)."""
    if budget is not None:
        return pack_rows(lengths, budget, size)
    return [range(start, min(start + size, len(lengths))) for start in range(0, len(lengths), size)]


def sequence_lengths(batch: TrainBatch) -> list[int]:
    """Real tokens (prompt + response) of each row."""
    return [int(n) for n in batch.attention_mask.sum(-1).tolist()]


def shared_layout(batch: TrainBatch) -> tuple[list[int], list[int], list, torch.Tensor, torch.Tensor] | None:
    """The packed row with each distinct prompt once, followed by its responses: flat ids, position ids, the
    attention groups ``(prompt start, prompt length, [(response start, end), ...])``, the flat index [n, T] of
    each (row, position) (-1 on padding) and each row's prompt length [n]. None when no prompt is shared or
    a row has no response (then the plain packed layout is used). A row's "prompt" is everything before its
    first trained token (an episode's opening observation included); an episode's later environment turns are
    response tokens like any other here, only the action mask keeps them out of the loss."""
    ids, mask, act = batch.input_ids, batch.attention_mask, batch.action_mask  # [n, T]
    n, width = ids.shape
    if bool((act.sum(-1) == 0).any()):
        return None
    starts = (act > 0).to(torch.int8).argmax(-1).tolist()  # prompt length = first trained position
    ends = mask.sum(-1).tolist()
    rows = ids.tolist()
    members: dict[tuple[int, ...], list[int]] = {}
    for i in range(n):
        members.setdefault(tuple(rows[i][:starts[i]]), []).append(i)
    if len(members) == n:
        return None
    flat_ids: list[int] = []
    positions: list[int] = []
    groups = []
    index = torch.full((n, width), -1, dtype=torch.long)
    for prompt, group in members.items():
        a, p = len(flat_ids), len(prompt)
        flat_ids += prompt
        positions += range(p)
        spans = []
        for i in group:
            b = len(flat_ids)
            flat_ids += rows[i][p:ends[i]]
            positions += range(p, ends[i])
            spans.append((b, len(flat_ids)))
            index[i, :p] = torch.arange(a, a + p)
            index[i, p:ends[i]] = torch.arange(b, len(flat_ids))
        groups.append((a, p, spans))
    return flat_ids, positions, groups, index, torch.tensor(starts)


def shared_packed_logprobs(model: Any, batch: TrainBatch, with_entropy: bool, layout: tuple):
    """``packed_logprobs`` over ``shared_layout``: each distinct prompt forwarded once in the packed row.

    Token t of a row is predicted at the flat position of its token t - 1; the
    first response token of every row is predicted at its prompt's last
    position, which the G responses share (its gradient gets all G terms).
    """
    flat_list, pos_list, groups, index, starts = layout
    device = batch.input_ids.device
    index, starts = index.to(device), starts.to(device)
    flat_ids = torch.tensor(flat_list, dtype=torch.long, device=device)[None]  # [1, S]
    positions = torch.tensor(pos_list, dtype=torch.long, device=device)[None]
    cu = torch.tensor([0, len(flat_list)], dtype=torch.int32, device=device)
    masks: dict[tuple[int, int], torch.Tensor] = {}  # built once per shape, not once per layer
    for _, p, spans in groups:
        for b, e in spans:
            if (p, e - b) not in masks:
                seen = torch.ones((e - b, p + e - b), dtype=torch.bool, device=device)
                seen[:, p:] = seen[:, p:].tril()
                masks[(p, e - b)] = seen[None, None]
    groups = [(a, p, [(b, e, masks[(p, e - b)]) for b, e in spans]) for a, p, spans in groups]
    logits = model(input_ids=flat_ids, position_ids=positions, use_cache=False, cu_seq_lens_q=cu,
                   cu_seq_lens_k=cu, rlctl_prompt_groups=groups).logits[0]  # [S, V]
    s = batch.sampling
    rows = torch.arange(index.shape[0], device=device)
    last = index[rows, starts - 1]  # [n] flat position of each row's last prompt token
    first_ids = batch.input_ids[rows, starts]  # [n] each row's first response token
    flat = torch.nn.functional.pad(token_logprobs(logits[None, :-1], flat_ids[:, 1:], s.temperature, s.top_k,
                                                  s.top_p)[0], (1, 0))  # [S]: flat token j predicted at j-1
    first = token_logprobs(logits[last][None], first_ids[None], s.temperature, s.top_k, s.top_p)[0]  # [n]
    steps = torch.arange(index.shape[1], device=device)[None]
    valid = (index >= 0) & (steps > 0)
    at_first = steps == starts[:, None]
    at = index.clamp(min=0)
    zero = torch.zeros((), dtype=flat.dtype, device=device)
    logp = torch.where(valid, torch.where(at_first, first[:, None], flat[at]), zero)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            shaped = logits if s.greedy else process_logits(logits.detach(), s.temperature, s.top_k, s.top_p)
            ent = entropy_from_logits(shaped)  # [S]: of the next token at each flat position
            ent_flat = torch.nn.functional.pad(ent[:-1], (1, 0))
            entropy = torch.where(valid, torch.where(at_first, ent[last][:, None], ent_flat[at]), zero)
    return logp, entropy
