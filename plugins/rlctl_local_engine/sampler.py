"""Batched autoregressive sampling with a KV cache on torch.

What this is: one function, ``sample``, that takes one row per sample (a prompt repeated G times),
left-pads, runs one prefill and then one cached decode step per new token,
and records each sampled token's log-probability under the distribution it
was actually drawn from (``rlctl.algo.sampling``: temperature, top-k, top-p).

Two decoders sit behind it:

- ``_LlamaDecoder``, the fast path for fp32 Llama-shaped models (``llama``,
  ``qwen2`` without sliding window; static RoPE): it runs the model's own
  weights through a preallocated static KV cache with a handful of torch ops
  per layer. The weights are refolded once per call: RMSNorm gains and the
  attention scale multiplied into the next projection, q/k/v and gate/up
  concatenated.
- ``_HFDecoder``, the generic path through ``model(...)`` with the HF cache,
  for every other architecture.

Work removed on every path: the G copies of a prompt are prefilled once
(their cache is copied), logits are computed for the last prompt position
only, and finished rows leave the batch (compaction) once a quarter of it is
idle. Both decoders compute the same function as the learner's full-sequence
forward (fp32 tolerance ~1e-6; tests/integration/test_reconcile.py checks
1e-4), so behaviour log-probs stay equal to the learner's recompute.

What this is not: continuous batching (slots.py, ``scheduler: slots``) or paged
attention (serving engines do that; see the sglang plugin).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlctl import SamplingConfig, TerminalReason
from rlctl.kit.algo import process_logits
from rlctl_local_engine.gemm import Linear

_REASONS = (TerminalReason.LENGTH, TerminalReason.EOS, TerminalReason.STOP, TerminalReason.ABORT)
_ABORTED = 3  # index of TerminalReason.ABORT
_FAST_MODEL_TYPES = ("llama", "qwen2")
_STATIC_ROPE = ("default", "linear", "llama3")
# Finished rows stay in the batch (computed, ignored) until at most this share of it is still live;
# then the batch and its KV cache are compacted. Compacting on every finish would copy the cache each step.
_COMPACT_AT = 0.75


@dataclass(frozen=True, slots=True)
class Sampled:
    tokens: list[list[int]]  # per row, response tokens (eos included when emitted)
    logprobs: list[list[float]]
    reasons: list[TerminalReason]


@torch.no_grad()
def sample(model: Any, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, eos_id: int,
           pad_id: int, generator: torch.Generator, stop_check: Any = None, fast: bool = True,
           abort: Any = None, min_lengths: Sequence[int] | None = None,
           max_lengths: Sequence[int] | None = None) -> Sampled:
    """Sample one response per row of ``prompts`` (callers repeat a prompt G times).

    ``fast=False`` forces the generic Hugging Face path (tests and benchmarks compare the two).
    ``abort()``, when given, is called between decode steps and returns the rows (indices into
    ``prompts``) to stop now; they end with TerminalReason.ABORT, and sampling ends once no row is live.
    ``min_lengths`` keeps row i decoding for at least that many positions even after its response
    ended (a long-tailed workload with real decode work); what follows the end is discarded, so
    the returned responses and log-probs are those of a plain run. ``max_lengths`` ends row i after that
    many tokens (TerminalReason.LENGTH; benchmarks give rows lengths of their own).
    """
    steps = sampling.max_tokens
    unique, expand = _dedupe(prompts)  # the G copies of a prompt are prefilled once
    ids, mask = _left_pad(unique, pad_id)  # [U, Lp]
    decoder = _LlamaDecoder(model, ids, mask, expand, steps) if fast and fast_path_supported(model) else \
        _HFDecoder(model, ids, mask, expand)
    out = _Rows(len(prompts), steps, pad_id, min_lengths, max_lengths)
    logits = decoder.prefill()  # [N, V]
    for t in range(steps):
        tok, lp = _draw(logits, sampling, generator)  # [n], [n]
        out.record(t, tok, lp, eos_id, stop_check)
        if abort is not None:
            out.abort(t, abort())
        if t + 1 == steps or out.num_live == 0:
            break
        keep = out.maybe_compact()
        if keep is not None:
            tok = tok[keep]
            decoder.keep(keep)
        logits = decoder.step(tok)
    return out.result()


class _Rows:
    """Per-row outputs. Rows of the running batch write one column per step; finished rows stay (ignored)
    until compaction moves their history to the output and drops them from the batch."""

    def __init__(self, n: int, steps: int, pad_id: int, min_lengths: Sequence[int] | None = None,
                 max_lengths: Sequence[int] | None = None) -> None:
        self.tokens = torch.full((n, steps), pad_id, dtype=torch.long)  # [N, S] by original row
        self.logps = torch.zeros((n, steps), dtype=torch.float32)
        self.lengths = torch.full((n,), steps, dtype=torch.long)
        self.reason = torch.zeros(n, dtype=torch.long)  # index into _REASONS
        self.batch_tokens, self.batch_logps = self.tokens, self.logps  # the running batch's rows
        self.rows = torch.arange(n)  # original row of each batch row
        self.live = torch.ones(n, dtype=torch.bool)
        self.num_live = n
        self.min_len = None if min_lengths is None else torch.tensor(list(min_lengths), dtype=torch.long)  # [N]
        self.first_end = torch.full((n,), steps + 1, dtype=torch.long)  # [N]: response end seen before min_len
        self.max_len = None if max_lengths is None else torch.tensor(list(max_lengths), dtype=torch.long)  # [N]

    def record(self, t: int, tok: torch.Tensor, lp: torch.Tensor, eos_id: int, stop_check: Any) -> None:
        self.batch_tokens[:, t] = tok
        self.batch_logps[:, t] = lp
        finished = (tok == eos_id) & self.live  # [n]
        if self.min_len is not None:
            short = t + 1 < self.min_len[self.rows]  # [n]: must keep decoding
            early = finished & short & (self.first_end[self.rows] > t + 1)  # first end of the response
            self.first_end[self.rows[early]] = t + 1
            self.reason[self.rows[early]] = 1
            padded = self.live & (self.first_end[self.rows] <= t + 1) & ~short
            finished = (finished & ~short & (self.first_end[self.rows] > t + 1)) | padded
        ended = bool(finished.any())
        if ended:
            self.reason[self.rows[finished]] = 1
        if stop_check is not None:
            for j in (self.live & ~finished & (self.first_end[self.rows] > t + 1)).nonzero().flatten().tolist():
                if stop_check(self.batch_tokens[j, : t + 1].tolist()):
                    finished[j], ended = True, True
                    self.reason[self.rows[j]] = 2
        if self.max_len is not None:
            capped = self.live & ~finished & (t + 1 >= self.max_len[self.rows])  # reason stays LENGTH
            finished, ended = finished | capped, ended or bool(capped.any())
        if ended:
            self.lengths[self.rows[finished]] = t + 1
            self.live &= ~finished
            self.num_live = int(self.live.sum())

    def abort(self, t: int, rows: Any) -> None:
        """End the still-live rows among ``rows`` (original indices) at step ``t``."""
        if not rows:
            return
        hit = torch.isin(self.rows, torch.as_tensor(list(rows), dtype=torch.long)) & self.live  # [n]
        if bool(hit.any()):
            self.reason[self.rows[hit]] = _ABORTED
            self.lengths[self.rows[hit]] = t + 1
            self.live &= ~hit
            self.num_live = int(self.live.sum())

    def maybe_compact(self) -> torch.Tensor | None:
        """Batch rows to keep once at most _COMPACT_AT of the batch is live, else None."""
        if self.num_live > _COMPACT_AT * self.live.numel():
            return None
        self._flush()
        keep = self.live.nonzero().squeeze(1)  # [n']
        self.rows, self.live = self.rows[keep], self.live[keep]
        self.batch_tokens, self.batch_logps = self.batch_tokens[keep], self.batch_logps[keep]
        return keep

    def _flush(self) -> None:
        if self.batch_tokens is not self.tokens:
            self.tokens[self.rows] = self.batch_tokens
            self.logps[self.rows] = self.batch_logps

    def result(self) -> Sampled:
        self._flush()
        lens = torch.minimum(self.lengths, self.first_end).tolist()  # cut what followed an early end
        tokens, logps = self.tokens.tolist(), self.logps.tolist()
        return Sampled(tokens=[row[:k] for row, k in zip(tokens, lens)],
                       logprobs=[row[:k] for row, k in zip(logps, lens)],
                       reasons=[_REASONS[c] for c in self.reason.tolist()])


def fast_path_supported(model: Any) -> bool:
    """True when ``model`` can run on the static-cache Llama decoder (else the HF path is used)."""
    cfg = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if cfg is None or inner is None or getattr(cfg, "model_type", None) not in _FAST_MODEL_TYPES:
        return False
    if getattr(cfg, "use_sliding_window", False) or getattr(inner, "rotary_emb", None) is None:
        return False
    if getattr(inner.rotary_emb, "rope_type", "default") not in _STATIC_ROPE:
        return False
    if inner.embed_tokens.weight.dtype != torch.float32:  # HF RMSNorm upcasts; the folded weights would not
        return False
    layer = inner.layers[0]
    return all(hasattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) and \
        all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _dedupe(prompts: Sequence[Sequence[int]]) -> tuple[list[Sequence[int]], torch.Tensor]:
    """Distinct prompts in first-seen order and, per row, the index of its prompt among them."""
    index: dict[tuple[int, ...], int] = {}
    rows = [index.setdefault(tuple(p), len(index)) for p in prompts]
    return [list(p) for p in index], torch.tensor(rows, dtype=torch.long)


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def _draw(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator):
    if sampling.greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
        tok = logp.argmax(-1)
    else:
        logp = torch.log_softmax(process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p), dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class _HFDecoder:
    """Generic path: the model's own forward with its cache (any causal LM)."""

    def __init__(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, expand: torch.Tensor) -> None:
        self.model, self.ids, self.mask, self.expand = model, ids, mask, expand
        self.positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [U, Lp]
        self.cache: Any = None

    def prefill(self) -> torch.Tensor:
        out = self.model(input_ids=self.ids, attention_mask=self.mask, position_ids=self.positions, use_cache=True,
                         logits_to_keep=1)
        self.cache = out.cache
        self.cache.batch_select_indices(self.expand)  # [U, ...] -> [N, ...]
        self.mask, self.next_pos = self.mask[self.expand], self.positions[self.expand, -1:] + 1  # [N, 1]
        return out.logits[self.expand, -1, :]

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask, self.next_pos = self.mask[rows], self.next_pos[rows]

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones((self.mask.shape[0], 1), dtype=torch.long)], dim=1)
        out = self.model(input_ids=tok[:, None], attention_mask=self.mask, position_ids=self.next_pos,
                         cache=self.cache, use_cache=True)
        self.cache, self.next_pos = out.cache, self.next_pos + 1
        return out.logits[:, -1, :]


class _LlamaDecoder:
    """Static-cache decoder over a Llama-shaped HF model's weights (same math as its forward).

    The prefill runs on the U distinct prompts; their keys and values are
    copied into the N = U x G rows of a cache preallocated for the whole
    response, so a decode step writes one position per layer.
    """

    def __init__(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, expand: torch.Tensor,
                 max_new: int) -> None:
        inner, cfg = model.model, model.config
        self.inner, self.ids, self.prompt_mask, self.expand = inner, ids, mask, expand
        self.head_dim = inner.layers[0].self_attn.head_dim
        self.num_heads, self.num_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.layers = [_LayerWeights.of(layer) for layer in inner.layers]
        # final RMSNorm gain folded into the LM head
        self.head = Linear(model.lm_head.weight * inner.norm.weight, getattr(model.lm_head, "bias", None))
        self.eps = _eps(inner.norm)
        width, n = ids.shape[1], expand.numel()
        total, dtype = width + max_new, inner.embed_tokens.weight.dtype
        self.positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [U, Lp]
        first = self.positions[expand, -1] + 1  # [N] position of the first new token
        table = torch.arange(int(first.max()) + max_new + 1)[None]  # [1, P]
        cos, sin = inner.rotary_emb(inner.embed_tokens.weight[:1], table)  # [1, P, d]
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, d/2) * (sin with its first half negated)
        self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # [P, d]
        steps = first[:, None] + torch.arange(max_new)[None]  # [N, S_new]: each row's positions, gathered once
        self.step_cos, self.step_sin = self.cos[steps], self.sin[steps]  # [N, S_new, d]
        self.new = 0  # decode steps taken
        shape = (n, self.num_kv, total, self.head_dim)
        self.k = [torch.empty(shape, dtype=dtype) for _ in inner.layers]
        self.v = [torch.empty(shape, dtype=dtype) for _ in inner.layers]
        # additive key mask: -inf on left padding, 0 on prompt and generated tokens
        self.bias = torch.zeros((n, total), dtype=dtype)  # [N, S]
        self.bias[:, :width].masked_fill_(mask[expand] == 0, float("-inf"))
        self.length = width

    def prefill(self) -> torch.Tensor:
        width = self.ids.shape[1]
        x = self.inner.embed_tokens(self.ids)  # [U, Lp, h]
        cos, sin = self.cos[self.positions][:, None], self.sin[self.positions][:, None]  # [U, 1, Lp, d]
        causal = torch.ones((width, width), dtype=torch.bool).tril()  # [Lp, Lp]
        allowed = causal[None] & (self.prompt_mask[:, None, :] == 1)  # [U, Lp, Lp]
        allowed |= torch.eye(width, dtype=torch.bool)[None]  # a pad query sees itself: no all-masked row
        bias = torch.zeros(allowed.shape, dtype=x.dtype).masked_fill_(~allowed, float("-inf"))[:, None]
        for i, w in enumerate(self.layers):
            x = self._layer(w, i, x, cos, sin, bias, 0)
        return self._logits(x[:, -1])[self.expand]  # [N, V]

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        x = self.inner.embed_tokens(tok[:, None])  # [n, 1, h]
        cos, sin = self.step_cos[:, self.new, None, None], self.step_sin[:, self.new, None, None]  # [n, 1, 1, d]
        at = self.length
        self.length, self.new = self.length + 1, self.new + 1
        bias = self.bias[:, None, None, : self.length]  # [n, 1, 1, S]
        for i, w in enumerate(self.layers):
            x = self._layer(w, i, x, cos, sin, bias, at)
        return self._logits(x[:, -1])  # [n, V]

    def keep(self, rows: torch.Tensor) -> None:
        """Drop finished rows: copy only the filled part of each cache row into a smaller cache."""
        self.k = [self._gather(k, rows) for k in self.k]
        self.v = [self._gather(v, rows) for v in self.v]
        self.bias, self.step_cos, self.step_sin = self.bias[rows], self.step_cos[rows], self.step_sin[rows]

    def _gather(self, cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty((rows.numel(), *cache.shape[1:]), dtype=cache.dtype)
        torch.index_select(cache[:, :, : self.length], 0, rows, out=out[:, :, : self.length])
        return out

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_normalized(x, self.eps))

    def _layer(self, w: "_LayerWeights", i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               bias: torch.Tensor, at: int) -> torch.Tensor:
        """LlamaDecoderLayer.forward on folded weights: norm, attention with RoPE, norm, gated MLP."""
        F = torch.nn.functional
        n, q_len, _ = x.shape
        heads, kv, d = self.num_heads, self.num_kv, self.head_dim
        h = _normalized(x, w.eps1)
        y = w.qkv(h).view(n, q_len, -1, d).transpose(1, 2)  # [n, H+2Hkv, q, d]
        qk = y[:, : heads + kv]
        qk = qk * cos + qk.roll(d // 2, dims=-1) * sin  # RoPE on queries and keys at once
        q, k, v = qk[:, :heads], qk[:, heads:], y[:, heads + kv:]
        if at == 0:  # prefill over the distinct prompts; every copy of a prompt gets its keys and values
            self.k[i][:, :, :q_len] = k[self.expand]
            self.v[i][:, :, :q_len] = v[self.expand]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0, enable_gqa=kv != heads)
            out = out.transpose(1, 2).reshape(n, q_len, heads * d)
        else:  # one query: grouped matmuls beat SDPA's kernel for tiny shapes
            self.k[i][:, :, at: at + 1] = k
            self.v[i][:, :, at: at + 1] = v
            keys, values = self.k[i][:, :, : at + 1], self.v[i][:, :, : at + 1]  # [n, Hkv, S, d]
            scores = torch.matmul(q.reshape(n, kv, heads // kv, d), keys.transpose(-1, -2))  # [n, Hkv, g, S]
            out = torch.matmul(torch.softmax(scores.add_(bias), dim=-1), values).view(n, 1, heads * d)
        x = x + w.o(out)
        gate, up = w.gate_up(_normalized(x, w.eps2)).chunk(2, dim=-1)
        return x + w.down(w.act(gate) * up)


@dataclass(frozen=True, slots=True)
class _LayerWeights:
    """One layer's weights, refolded for decoding (the decoder's own copy; the model is not touched).

    ``qkv`` stacks the q, k and v rows with the input RMSNorm gain multiplied
    into every column and the attention scale into q (RoPE is linear, so the
    scale commutes with it); ``gate_up`` stacks gate and up with the
    post-attention gain. Each projection is a gemm.Linear (packed for oneDNN when large).
    """

    eps1: float
    qkv: Linear
    o: Linear
    eps2: float
    gate_up: Linear
    down: Linear
    act: Any

    @classmethod
    def of(cls, layer: Any, *, transposed: bool = False) -> "_LayerWeights":
        a, m = layer.self_attn, layer.mlp
        scale = a.scaling
        blocks = [a.q_proj.weight * scale, a.k_proj.weight, a.v_proj.weight]
        bias = None
        if a.q_proj.bias is not None:
            bias = torch.cat([a.q_proj.bias * scale, a.k_proj.bias, a.v_proj.bias])
        gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight]) * layer.post_attention_layernorm.weight
        return cls(eps1=_eps(layer.input_layernorm),
                   qkv=Linear(torch.cat(blocks) * layer.input_layernorm.weight, bias, transposed=transposed),
                   o=Linear(a.o_proj.weight, a.o_proj.bias, transposed=transposed),
                   eps2=_eps(layer.post_attention_layernorm), gate_up=Linear(gate_up, None, transposed=transposed),
                   down=Linear(m.down_proj.weight, None, transposed=transposed), act=m.act_fn)


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its gain (folded into the next weight), HF's exact formula for fp32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))


def _eps(norm: Any) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
