"""The slot scheduler's decoder: the static-cache Llama decoder with a position and a cache region per slot.

What this is: ``_SlotDecoder`` (prefill of distinct prompts, per-slot cache load, one masked decode step over
every slot that may prefill prompts in the same forward, compaction and growth of the slot batch and of the
cache's capacity) for slots.py. What this is not:
a scheduler (slots.py decides which row sits in which slot) nor paged attention.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from rlctl_local_engine.gemm import Linear
from rlctl_local_engine.sampler import _LayerWeights, _eps, _left_pad, _normalized

Prefilled = tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]  # per-layer keys, values; last logits
_MIN_ROWS = 2  # one-row products take MKL's GEMV path, whose sums differ from the GEMM rows of larger batches


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
        self.layers = [_LayerWeights.of(layer, transposed=True) for layer in inner.layers]
        head = model.lm_head.weight * inner.norm.weight
        self.head = Linear(head, getattr(model.lm_head, "bias", None), transposed=True)
        self.vocab, self.eps = head.shape[0], _eps(inner.norm)
        self.embed = inner.embed_tokens.weight.detach().clone()  # every weight is this decoder's own copy: a
        self.dtype = self.embed.dtype  # session goes on with its weights after the model is updated
        self.clear()
        self.resize(slots, capacity)

    def clear(self) -> None:
        """No slots and no capacity (resize grows them again); the weights are kept."""
        self.capacity = 0
        self.k = [torch.zeros((0, self.num_kv, 0, self.head_dim), dtype=self.dtype) for _ in self.layers]
        self.v = [k.clone() for k in self.k]
        self.bias = torch.zeros((0, 0), dtype=self.dtype)
        self.pos = torch.zeros(0, dtype=torch.long)  # next position to write, per slot

    @property
    def slots(self) -> int:
        return self.pos.numel()

    def resize(self, slots: int, capacity: int) -> None:
        """Grow to ``slots`` slots (new ones free) and ``capacity`` positions per slot (new ones masked)."""
        more, wider = max(0, slots - self.slots), max(0, capacity - self.capacity)
        if wider:
            self.capacity = capacity
            cos, sin = self.inner.rotary_emb(self.inner.embed_tokens.weight[:1], torch.arange(capacity + 1)[None])
            half = self.head_dim // 2
            self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # [P, d]
        if not (more or wider):
            return

        def grown(x: torch.Tensor, fill: float) -> torch.Tensor:  # zeros: masked keys never hold NaN
            pad = [0, 0, 0, wider] if x.dim() == 4 else [0, wider]
            x = torch.nn.functional.pad(x, pad, value=fill) if wider else x
            if more:
                x = torch.cat([x, torch.full((more, *x.shape[1:]), fill, dtype=x.dtype)])
            return x

        self.k = [grown(k, 0.0) for k in self.k]
        self.v = [grown(v, 0.0) for v in self.v]
        self.bias = grown(self.bias, float("-inf"))
        self.pos = torch.cat([self.pos, torch.zeros(more, dtype=torch.long)])

    def prefill(self, prompts: Sequence[Sequence[int]]) -> list[Prefilled]:
        """Left-padded prompts together: per prompt, its per-layer keys and values (padding cut) and last logits."""
        return self.step(None, None, prompts)[1]

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

    def step(self, tok: torch.Tensor | None, active: torch.Tensor | None,
             prompts: Sequence[Sequence[int]] = ()) -> tuple[torch.Tensor, list[Prefilled]]:
        """One token per slot (only ``active`` slots write their key, unmasked, and advance) and, in the same
        forward, the prefill of ``prompts``: the slots' next logits and what ``prefill`` returns for the prompts.

        Every token of the step (a slot's one, each prompt position) is a row of the same weight products, so a
        prompt admitted while others decode costs rows of a product the step makes anyway instead of a forward
        of its own (the weights are read once); only attention is computed per part.
        """
        n = 0 if tok is None else tok.numel()
        x, cos, sin = [], [], []
        decode = prefill = None
        if n:
            at = self.pos.clamp(max=self.capacity - 1)  # [n]
            x.append(torch.nn.functional.embedding(tok, self.embed))  # [n, h]
            cos.append(self.cos[at])
            sin.append(self.sin[at])
            self.bias[active.nonzero().flatten(), at[active]] = 0.0
            decode = (at, self.bias[:, None, None, :])  # the whole capacity: see _SlotDecoder
        if prompts:
            ids, mask = _left_pad(prompts, 0)
            count, width = ids.shape
            positions = (mask.cumsum(-1) - 1).clamp(min=0).flatten()  # [U * Lp]
            x.append(torch.nn.functional.embedding(ids.flatten(), self.embed))  # [U * Lp, h]
            cos.append(self.cos[positions])
            sin.append(self.sin[positions])
            allowed = torch.ones((width, width), dtype=torch.bool).tril()[None] & (mask[:, None, :] == 1)
            allowed |= torch.eye(width, dtype=torch.bool)[None]  # a pad query sees itself: no all-masked row
            bias = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, float("-inf"))[:, None]
            prefill = (count, width, bias)
        h = torch.cat(x) if len(x) > 1 else x[0]  # [T, h]: the slots' tokens, then the prompts' positions
        rope = (torch.cat(cos)[:, None], torch.cat(sin)[:, None])  # [T, 1, d]
        ks, vs = [], []
        for i, w in enumerate(self.layers):
            h, k, v = self._layer(w, i, h, rope, n, decode, prefill)
            ks.append(k)
            vs.append(v)
        last = h[:n]
        if prefill is not None:
            last = torch.cat([last, h[n:].view(count, width, -1)[:, -1]])
        logits = self._logits(last)  # [n + U, V]
        if n:
            self.pos = self.pos + active.long()
        out = [([k[u, :, width - len(p):].clone() for k in ks], [v[u, :, width - len(p):].clone() for v in vs],
                logits[n + u]) for u, p in enumerate(prompts)]
        return logits[:n], out

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_normalized(x, self.eps))

    def _layer(self, w: _LayerWeights, i: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], n: int,
               decode: tuple[torch.Tensor, torch.Tensor] | None, prefill: tuple[int, int, torch.Tensor] | None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One layer on ``[T, h]`` tokens: the ``n`` slots' (``decode``: write positions, key mask) then the
        prompts' (``prefill``: count, padded width, causal mask); the prompts' keys and values are returned."""
        heads, kv, d = self.num_heads, self.num_kv, self.head_dim
        y = w.qkv(_normalized(x, w.eps1)).view(x.shape[0], -1, d)  # [T, H + 2Hkv, d]
        cos, sin = rope
        qk = y[:, : heads + kv]
        qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
        q, k, v = qk[:, :heads], qk[:, heads:], y[:, heads + kv:]
        out, pk, pv = [], None, None
        if decode is not None:
            at, bias = decode
            rows = torch.arange(n)
            self.k[i][rows, :, at] = k[:n]
            self.v[i][rows, :, at] = v[:n]
            keys, values = self.k[i], self.v[i]  # [n, Hkv, S, d]
            scores = torch.matmul(q[:n].reshape(n, kv, heads // kv, d), keys.transpose(-1, -2))  # [n, Hkv, g, S]
            out.append(torch.matmul(torch.softmax(scores.add_(bias), dim=-1), values).view(n, heads * d))
        if prefill is not None:
            count, width, bias = prefill
            pq, pk, pv = (t[n:].view(count, width, -1, d).transpose(1, 2) for t in (q, k, v))  # [U, H(kv), Lp, d]
            att = torch.nn.functional.scaled_dot_product_attention(pq, pk, pv, attn_mask=bias, scale=1.0,
                                                                   enable_gqa=kv != heads)
            out.append(att.transpose(1, 2).reshape(count * width, heads * d))
        x = x + w.o(torch.cat(out) if len(out) > 1 else out[0])
        gate, up = w.gate_up(_normalized(x, w.eps2)).chunk(2, dim=-1)
        return x + w.down(w.act(gate) * up), pk, pv

