"""Slot-scheduled (continuous-batching) sampling on the static-cache Llama decoder.

What this is: ``sample_slots``, the same contract as ``sampler.sample`` (one response per row, in row
order) run on a fixed number of decode slots. Rows are admitted in order; a row that ends (EOS, stop,
its max tokens, abort) frees its slot, and the next queued row takes it at once while the others keep
decoding. Each slot has its own position and its own region of a per-slot KV cache, so a row's keys
sit at positions 0.. of its slot whatever the schedule. A prompt is prefilled once (32 distinct prompts per
prefill, in call order): its keys, values and last logits are kept until every one of its rows (the G
samples) has been admitted and are copied into each row's slot. Once the queue is empty and at most three
quarters of the slots are live, the batch is compacted as in ``sampler.sample``.

Schedule-independent samples: a row's draws come from its own stream, a counter-based hash of
(``keys[row]``, token index), turned into a token by inverse-CDF over the processed distribution. Prefill
batches depend on the call only. A row's decode logits do not depend on which other rows share its forward
where the matmul kernels are batch-invariant: the decoder multiplies by pre-transposed weights with at
least 2 rows and attends over the whole cache width, which on an Intel CPU/MKL host gave bit-equal rows for
every batch size at the tiny shapes. That is the machine's kernels, not a guarantee: on an AMD EPYC host the
same test model's log-probs moved by up to 5.3e-5 between slot counts (tokens still equal), and hidden 896 was
not batch-invariant for x @ W even on the Intel host (GPUs untested). tests/unit/test_slot_engine.py checks
identical tokens and log-probs within the 1e-4 mismatch bound. Where kernels are not batch-invariant a draw
changes only if its uniform lands that close to a CDF boundary. The same requests, slot count and keys always give the same schedule, so a
resumed run is bitwise equal to a straight one whatever the kernels.

What this is not: paged attention (the per-slot cache is sized for the call's longest prompt + max tokens)
nor the HF generic path (models off the fast path use ``scheduler: batch``).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import torch

from rlctl import SamplingConfig
from rlctl.kit.algo import process_logits
from rlctl_local_engine.sampler import _REASONS, Sampled, _LayerWeights, _eps, _left_pad, _normalized

_MASK32 = 0xFFFFFFFF
_COMPACT_AT = 0.75  # as sampler._COMPACT_AT: compact the drained batch once at most this share is live
_MIN_ROWS = 2  # one-row products take MKL's GEMV path, whose sums differ from the GEMM rows of larger batches
_LENGTH, _EOS, _STOP, _ABORT = range(4)  # indices into _REASONS
# Distinct prompts are prefilled together in this many, in the order the call names them: the prefill's
# shapes depend on the call only, never on which slots are free.
_PREFILL_PROMPTS = 32


@torch.no_grad()
def sample_slots(model: Any, prompts: Sequence[Sequence[int]], keys: Sequence[int], sampling: SamplingConfig, *,
                 eos_id: int, num_slots: int, stop_check: Any = None, abort: Any = None,
                 min_lengths: Sequence[int] | None = None, max_lengths: Sequence[int] | None = None) -> Sampled:
    """Sample one response per row of ``prompts`` on ``num_slots`` decode slots.

    ``keys[row]`` seeds row ``row``'s random stream (64-bit ints; equal keys draw equal samples).
    ``abort()`` returns rows to stop now: a live row ends with TerminalReason.ABORT, a queued one ends
    empty. ``min_lengths`` as in ``sampler.sample`` (long-tail benchmark work, responses unchanged);
    ``max_lengths`` caps row i at that many tokens (default: ``sampling.max_tokens`` for every row).
    """
    n, steps = len(prompts), sampling.max_tokens
    limit = torch.full((n,), steps, dtype=torch.long) if max_lengths is None else \
        torch.tensor(list(max_lengths), dtype=torch.long).clamp(max=steps)
    min_len = None if min_lengths is None else torch.tensor(list(min_lengths), dtype=torch.long)
    batch = max(_MIN_ROWS, min(num_slots, n))
    dec = _SlotDecoder(model, batch, max(map(len, prompts)) + steps)
    state = _Slots(n, batch, steps, dec.vocab)
    streams = None if sampling.greedy else uniforms(keys, steps)  # [N, S]: row r's draw for its token t
    queue = deque(range(n))
    prefixes = _Prefixes(prompts, dec)
    state.admit(queue, prefixes, dec)
    while True:
        live = state.row >= 0
        u = None if streams is None else streams[state.row.clamp(min=0), state.t.clamp(max=steps - 1)]
        tok, lp = _draw(state.logits, sampling, u)
        state.record(live, tok, lp, eos_id, limit, min_len, stop_check)
        if abort is not None:
            state.abort(abort(), queue)
        if not queue and not bool((state.row >= 0).any()):
            break
        fresh = state.admit(queue, prefixes, dec)
        if not queue:
            keep = state.maybe_compact()
            if keep is not None:
                dec.keep(keep)
                tok, fresh = tok[keep], fresh[keep]
        active = (state.row >= 0) & ~fresh
        if bool(active.any()):
            state.logits = torch.where(active[:, None], dec.step(tok, active), state.logits)
    return state.result()


class _Slots:
    """Which row each batch slot holds, its token count and pending logits; the rows' outputs."""

    def __init__(self, n: int, batch: int, steps: int, vocab: int) -> None:
        self.tokens = torch.zeros((n, steps), dtype=torch.long)
        self.logps = torch.zeros((n, steps), dtype=torch.float32)
        self.lengths = torch.zeros(n, dtype=torch.long)
        self.reason = torch.full((n,), _ABORT, dtype=torch.long)  # rows never admitted stay aborted (and empty)
        self.first_end = torch.full((n,), steps + 1, dtype=torch.long)  # response end before min_len
        self.row = torch.full((batch,), -1, dtype=torch.long)  # row in each slot, -1 = free
        self.t = torch.zeros(batch, dtype=torch.long)  # tokens drawn so far by the slot's row
        self.logits = torch.zeros((batch, vocab), dtype=torch.float32)

    def admit(self, queue: deque, prefixes: "_Prefixes", dec: "_SlotDecoder") -> torch.Tensor:
        """Queued rows into free slots (lowest slot first); their first logits come from their prompt's prefill."""
        fresh = torch.zeros(self.row.numel(), dtype=torch.bool)
        for slot in (self.row < 0).nonzero().flatten().tolist():
            if not queue:
                break
            r = queue.popleft()
            ks, vs, logits = prefixes.take(r)
            dec.load(slot, ks, vs)
            self.row[slot], self.t[slot], self.reason[r] = r, 0, _LENGTH
            self.logits[slot] = logits
            fresh[slot] = True
        return fresh

    def record(self, live: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor, eos_id: int, limit: torch.Tensor,
               min_len: torch.Tensor | None, stop_check: Any) -> None:
        slots = live.nonzero().flatten()
        rows, t, tok = self.row[slots], self.t[slots], tok[slots]
        self.tokens[rows, t], self.logps[rows, t] = tok, lp[slots]
        t = t + 1
        self.t[slots] = t
        if min_len is None and stop_check is None:  # the common case: a row ends at EOS or its limit
            eos = tok == eos_id
            done = eos | (t >= limit[rows])
            if bool(done.any()):
                self.reason[rows[eos]] = _EOS
                self.first_end[rows[eos]] = t[eos]
                self._finish(slots[done], t[done])
            return
        open_ = self.first_end[rows] > t  # response still running (not ended before min_len)
        ended = (tok == eos_id) & open_
        if stop_check is not None:
            for j in (open_ & ~ended).nonzero().flatten().tolist():
                if stop_check(self.tokens[rows[j], : t[j]].tolist()):
                    ended[j] = True
                    self.reason[rows[j]] = _STOP
        self.reason[rows[ended & (tok == eos_id)]] = _EOS
        self.first_end[rows[ended]] = t[ended]
        done = (t >= limit[rows]) | ((self.first_end[rows] <= t) if min_len is None else
                                     ((self.first_end[rows] <= t) & (t >= min_len[rows])))
        self._finish(slots[done], t[done])

    def abort(self, rows: Any, queue: deque) -> None:
        """End the live rows among ``rows`` now; queued ones are dropped from the queue (empty, aborted)."""
        if not rows:
            return
        stop = set(rows)
        if queue and stop & set(queue):
            kept = [r for r in queue if r not in stop]
            queue.clear()
            queue.extend(kept)
        hit = ((self.row >= 0) & torch.isin(self.row, torch.tensor(sorted(stop), dtype=torch.long))).nonzero()
        hit = hit.flatten()
        if hit.numel():
            self.reason[self.row[hit]] = _ABORT
            self.first_end[self.row[hit]] = torch.minimum(self.first_end[self.row[hit]], self.t[hit])
            self._finish(hit, self.t[hit])

    def _finish(self, slots: torch.Tensor, t: torch.Tensor) -> None:
        rows = self.row[slots]
        self.lengths[rows] = torch.minimum(t, self.first_end[rows])  # cut what followed an early end
        self.row[slots] = -1

    def maybe_compact(self) -> torch.Tensor | None:
        """Slots to keep once the queue is drained and at most _COMPACT_AT of them are live, else None."""
        live = self.row >= 0
        num_live, size = int(live.sum()), live.numel()
        if size <= _MIN_ROWS or num_live > _COMPACT_AT * size:
            return None
        keep = live.nonzero().flatten()
        if keep.numel() < _MIN_ROWS:  # pad with free slots: a one-row batch would change the kernels
            keep = torch.cat([keep, (~live).nonzero().flatten()[: _MIN_ROWS - keep.numel()]]).sort().values
        self.row, self.t, self.logits = self.row[keep], self.t[keep], self.logits[keep]
        return keep

    def result(self) -> Sampled:
        lengths, tokens, logps = self.lengths.tolist(), self.tokens.tolist(), self.logps.tolist()
        return Sampled(tokens=[row[:k] for row, k in zip(tokens, lengths)],
                       logprobs=[row[:k] for row, k in zip(logps, lengths)],
                       reasons=[_REASONS[c] for c in self.reason.tolist()])


class _Prefixes:
    """Each distinct prompt's keys, values and last logits, prefilled _PREFILL_PROMPTS prompts at a time when
    the first row of the batch is admitted, and dropped once every row of that prompt has been."""

    def __init__(self, prompts: Sequence[Sequence[int]], dec: "_SlotDecoder") -> None:
        index: dict[tuple[int, ...], int] = {}
        self.of_row = [index.setdefault(tuple(p), len(index)) for p in prompts]
        self.distinct = [list(p) for p in index]
        self.left = [0] * len(self.distinct)
        for u in self.of_row:
            self.left[u] += 1
        self.ready: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]] = {}
        self.dec = dec

    def take(self, row: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        u = self.of_row[row]
        if u not in self.ready:
            start = u - u % _PREFILL_PROMPTS
            batch = self.distinct[start: start + _PREFILL_PROMPTS]
            self.ready.update(zip(range(start, start + len(batch)), self.dec.prefill(batch)))
        self.left[u] -= 1
        return self.ready.pop(u) if self.left[u] == 0 else self.ready[u]


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


class _SlotDecoder:
    """The Llama decoder of ``sampler._LlamaDecoder`` with a position and a cache region per slot.

    Cache ``[slots, Hkv, capacity, d]``: a slot's prompt at 0..L-1, its new tokens after; an additive key
    mask per slot (-inf where nothing is written). Weights are refolded as in the batch decoder and stored
    transposed (see _MIN_ROWS). A decode step attends over the whole capacity, masked: the score and value
    products then have one shape for the whole call whatever the other slots hold (trimming to the batch's
    longest row made MKL pick kernels by that width, and a row's scores changed in the last bits with the
    schedule).
    """

    def __init__(self, model: Any, slots: int, capacity: int) -> None:
        inner, cfg = model.model, model.config
        self.inner = inner
        self.head_dim = inner.layers[0].self_attn.head_dim
        self.num_heads, self.num_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.layers = [_Transposed.of(_LayerWeights.of(layer)) for layer in inner.layers]
        head = model.lm_head.weight * inner.norm.weight
        self.head, self.head_bias = head.t().contiguous(), getattr(model.lm_head, "bias", None)
        self.vocab, self.eps = head.shape[0], _eps(inner.norm)
        table = torch.arange(capacity + 1)[None]
        cos, sin = inner.rotary_emb(inner.embed_tokens.weight[:1], table)  # [1, P, d]
        half = self.head_dim // 2
        self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # [P, d]
        dtype = inner.embed_tokens.weight.dtype
        shape = (slots, self.num_kv, capacity, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in inner.layers]  # zeros: masked keys never hold NaN
        self.v = [torch.zeros(shape, dtype=dtype) for _ in inner.layers]
        self.bias = torch.full((slots, capacity), float("-inf"), dtype=dtype)
        self.pos = torch.zeros(slots, dtype=torch.long)  # next position to write, per slot
        self.capacity = capacity

    def prefill(self, prompts: Sequence[Sequence[int]]
                ) -> list[tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]]:
        """Left-padded prompts together: per prompt, its per-layer keys and values (padding cut) and last logits."""
        ids, mask = _left_pad(prompts, 0)
        count, width = ids.shape
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [U, Lp]
        x = self.inner.embed_tokens(ids)  # [U, Lp, h]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [U, 1, Lp, d]
        allowed = torch.ones((width, width), dtype=torch.bool).tril()[None] & (mask[:, None, :] == 1)
        allowed |= torch.eye(width, dtype=torch.bool)[None]  # a pad query sees itself: no all-masked row
        bias = torch.zeros(allowed.shape, dtype=x.dtype).masked_fill_(~allowed, float("-inf"))[:, None]
        ks, vs = [], []
        for w in self.layers:
            x, k, v = self._layer(w, x, cos, sin, bias, None)
            ks.append(k)
            vs.append(v)
        logits = self._logits(x[:, -1])  # [U, V]
        return [([k[u, :, width - len(p):].clone() for k in ks], [v[u, :, width - len(p):].clone() for v in vs],
                 logits[u]) for u, p in enumerate(prompts)]

    def load(self, slot: int, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        width = ks[0].shape[1]
        for i in range(len(self.layers)):
            self.k[i][slot, :, :width] = ks[i]
            self.v[i][slot, :, :width] = vs[i]
        self.bias[slot] = float("-inf")
        self.bias[slot, :width] = 0.0
        self.pos[slot] = width

    def keep(self, slots: torch.Tensor) -> None:
        self.k = [k[slots] for k in self.k]
        self.v = [v[slots] for v in self.v]
        self.bias, self.pos = self.bias[slots], self.pos[slots]

    def step(self, tok: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """One token per slot; only ``active`` slots write their key (unmasked) and advance."""
        at = self.pos.clamp(max=self.capacity - 1)  # [n]
        x = self.inner.embed_tokens(tok[:, None])  # [n, 1, h]
        cos, sin = self.cos[at][:, None, None], self.sin[at][:, None, None]  # [n, 1, 1, d]
        self.bias[active.nonzero().flatten(), at[active]] = 0.0
        bias = self.bias[:, None, None, :]  # the whole capacity: see _SlotDecoder
        for w_i, w in enumerate(self.layers):
            x, _, _ = self._layer(w, x, cos, sin, bias, (w_i, at))
        self.pos = self.pos + active.long()
        return self._logits(x[:, -1])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.matmul(_normalized(x, self.eps), self.head)
        return out if self.head_bias is None else out + self.head_bias

    def _layer(self, w: "_Transposed", x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor,
               decode: tuple[int, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, q_len, _ = x.shape
        heads, kv, d = self.num_heads, self.num_kv, self.head_dim
        y = _linear(_normalized(x, w.eps1), w.qkv, w.qkv_bias).view(n, q_len, -1, d).transpose(1, 2)
        qk = y[:, : heads + kv]
        qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
        q, k, v = qk[:, :heads], qk[:, heads:], y[:, heads + kv:]
        if decode is None:  # prefill
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0,
                                                                   enable_gqa=kv != heads)
            out = out.transpose(1, 2).reshape(n, q_len, heads * d)
        else:
            i, at = decode
            rows = torch.arange(n)
            self.k[i][rows, :, at] = k[:, :, 0]
            self.v[i][rows, :, at] = v[:, :, 0]
            keys, values = self.k[i], self.v[i]  # [n, Hkv, S, d]
            scores = torch.matmul(q.reshape(n, kv, heads // kv, d), keys.transpose(-1, -2))  # [n, Hkv, g, S]
            out = torch.matmul(torch.softmax(scores.add_(bias), dim=-1), values).view(n, 1, heads * d)
        x = x + _linear(out, w.o, w.o_bias)
        gate, up = _linear(_normalized(x, w.eps2), w.gate_up, None).chunk(2, dim=-1)
        return x + _linear(w.act(gate) * up, w.down, None), k, v


class _Transposed:
    """_LayerWeights with every matrix stored as [in, out] (x @ W: batch-invariant GEMM rows, see _MIN_ROWS)."""

    __slots__ = ("eps1", "qkv", "qkv_bias", "o", "o_bias", "eps2", "gate_up", "down", "act")

    @classmethod
    def of(cls, w: _LayerWeights) -> "_Transposed":
        out = cls()
        out.eps1, out.eps2, out.act, out.qkv_bias, out.o_bias = w.eps1, w.eps2, w.act, w.qkv_bias, w.o_bias
        out.qkv, out.o = w.qkv.t().contiguous(), w.o.t().contiguous()
        out.gate_up, out.down = w.gate_up.t().contiguous(), w.down.t().contiguous()
        return out


def _linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.matmul(x, weight_t)
    return out if bias is None else out + bias
