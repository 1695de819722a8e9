"""Packed learner micro-batches: whole sequences laid end to end under a token budget, no padding.

What this is: ``pack_rows`` (which rows of a batch share a micro-batch when
``train.micro_batch_tokens`` is set) and ``packed_logprobs`` (the forward of
one such micro-batch). A packed micro-batch is one row of ``S`` tokens: the
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
per-token log-probs (and entropy) are put back in the padded ``[n, T]``
layout of the micro-batch, so the loss, its normalisation and every metric
are computed by exactly the same code as the padded path; only the forward
differs (no FLOPs on padding, and no micro-batch padded to the batch's
longest sequence).

What this is not: prompt-prefill sharing (rlctl.kit.prefill; a packed
micro-batch forwards each sequence's prompt itself) or a varlen attention
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
    for key_name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(key_name, None)
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    bounds = cu.tolist()
    outs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                   is_causal=True, **kwargs)[0] for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=1), None  # [1, S, heads, head_dim], as sdpa_attention_forward returns


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


def packed_logprobs(model: Any, batch: TrainBatch, with_entropy: bool):
    """``TorchLearner._logprobs`` of a micro-batch forwarded packed: the same ``[n, T]`` tensors, 0 on padding.

    Token t of a row is predicted at flat position t - 1 of the same row; the
    first token of every row has no prediction (0, as in the padded path).
    """
    ids, mask = batch.input_ids, batch.attention_mask  # [n, T]
    flat_ids, positions, index = packed_inputs(mask, ids)
    lengths = mask.sum(-1)
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)  # [n + 1] sequence bounds
    top = int(lengths.max())
    # no attention mask and no cache: the sequences are told apart by cu_seq_lens and the position ids
    logits = model(input_ids=flat_ids, position_ids=positions, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                   max_length_q=top, max_length_k=top).logits[0, :-1]  # [S-1, V]
    s = batch.sampling
    flat = torch.nn.functional.pad(token_logprobs(logits[None], flat_ids[:, 1:], s.temperature, s.top_k,
                                                  s.top_p)[0], (1, 0))  # [S]: flat token j predicted at j-1
    valid = index > 0  # [n, T]
    valid[:, 0] = False  # a row's first token is predicted from the previous row's last: not this row's
    at = index.clamp(min=0)
    logp = torch.where(valid, flat[at], torch.zeros((), dtype=flat.dtype, device=flat.device))
    entropy = None
    if with_entropy:
        with torch.no_grad():
            shaped = logits if s.greedy else process_logits(logits.detach(), s.temperature, s.top_k, s.top_p)
            ent = torch.nn.functional.pad(entropy_from_logits(shaped), (1, 0))  # [S]
            entropy = torch.where(valid, ent[at], torch.zeros((), dtype=ent.dtype, device=ent.device))
    return logp, entropy


def sequence_lengths(batch: TrainBatch) -> list[int]:
    """Real tokens (prompt + response) of each row."""
    return [int(n) for n in batch.attention_mask.sum(-1).tolist()]
