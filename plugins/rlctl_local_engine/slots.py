"""Slot-scheduled (continuous-batching) sampling on the static-cache Llama decoder.

What this is: ``SlotSession``, continuous batching on a fixed number of decode slots that takes rows at any
time (``rlctl serve rollout``'s continuous scheduler and continuous rollout use it through
``LocalEngine.open_session``), and ``sample_slots``, the same contract as ``sampler.sample`` (one response per
row, in row order): a session given every row at once and drained. Rows are admitted in order; a row that
ends (EOS, stop, its max tokens, abort) frees its slot, and the next queued row takes it at the end of that
step while the others keep decoding. Each slot has its own position and its own region of a per-slot KV
cache, so a row's keys sit at positions 0.. of its slot whatever the schedule. A prompt is prefilled once
(those rows need now, then the next waiting ones in the order added, 32 distinct prompts per prefill), inside
the decode step's forward when rows are decoding (its positions are rows of the same weight products; 4-8%
more tokens/s on an in-process replay of the serve bench's arrivals) and on its own otherwise: its keys,
values and last logits are kept until every one of its rows (the G samples) has been admitted and are copied
into each row's slot. Once the queue is empty and at most three quarters of the slots are live, the batch is
compacted as in ``sampler.sample``.

Schedule-independent samples: a row's draws come from its own stream (streams.py), a counter-based hash of
(``keys[row]``, token index), turned into a token by inverse-CDF over the processed distribution. A row's
logits do not depend on which other rows share its forward where the matmul kernels are batch-invariant: the
decoder multiplies by pre-transposed weights (weights from 256 x 768 up: oneDNN-packed, gemm.py) with at
least 2 rows and attends over the whole cache width, which on an Intel CPU/MKL host gave bit-equal rows for
every batch size at the tiny shapes. That is the machine's kernels, not a guarantee: on an AMD EPYC host the
same test model's log-probs moved by up to 5.3e-5 between slot counts (tokens still equal), and hidden 896 was
not batch-invariant for x @ W even on the Intel host (GPUs untested). tests/unit/test_slot_engine.py checks
identical tokens and log-probs within the 1e-4 mismatch bound. Where kernels are not batch-invariant a draw
changes only if its uniform lands that close to a CDF boundary. The same requests, slot count and keys always
give the same schedule, so a resumed run is bitwise equal to a straight one whatever the kernels.

What this is not: paged attention (the per-slot cache is sized for the call's longest prompt + max tokens)
nor the HF generic path (models off the fast path use ``scheduler: batch``).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlctl import SamplingConfig, TerminalReason
from rlctl_local_engine.sampler import _REASONS, Sampled
from rlctl_local_engine.slot_decoder import _MIN_ROWS, Prefilled, _SlotDecoder
from rlctl_local_engine.streams import _distribution, _draw, uniforms

_COMPACT_AT = 0.75  # as sampler._COMPACT_AT: compact the drained batch once at most this share is live
_LENGTH, _EOS, _STOP, _ABORT = range(4)  # indices into _REASONS
# Distinct prompts are prefilled together in this many, in the order the call names them: the prefill's
# shapes depend on the call only, never on which slots are free.
_PREFILL_PROMPTS = 32
_NEVER = 1 << 40  # first_end of a row whose response has not ended


@torch.no_grad()
def sample_slots(model: Any, prompts: Sequence[Sequence[int]], keys: Sequence[int], sampling: SamplingConfig, *,
                 eos_id: int, num_slots: int, stop_check: Any = None, abort: Any = None,
                 min_lengths: Sequence[int] | None = None, max_lengths: Sequence[int] | None = None) -> Sampled:
    """Sample one response per row of ``prompts`` on ``num_slots`` decode slots (one SlotSession, drained).

    ``keys[row]`` seeds row ``row``'s random stream (64-bit ints; equal keys draw equal samples).
    ``abort()`` returns rows to stop now: a live row ends with TerminalReason.ABORT, a queued one ends
    empty. ``min_lengths`` as in ``sampler.sample`` (long-tail benchmark work, responses unchanged);
    ``max_lengths`` caps row i at that many tokens (default: ``sampling.max_tokens`` for every row).
    """
    session = SlotSession(model, eos_id=eos_id, num_slots=num_slots)
    for i, (prompt, key) in enumerate(zip(prompts, keys)):
        session.add(prompt, key, sampling, stop_check=stop_check,
                    max_tokens=None if max_lengths is None else max_lengths[i],
                    min_length=None if min_lengths is None else min_lengths[i])
    out: list[Done | None] = [None] * len(prompts)
    while not session.idle:
        for done in session.step(abort):
            out[done.row] = done
    return Sampled(tokens=[d.tokens for d in out], logprobs=[d.logprobs for d in out],
                   reasons=[d.reason for d in out])


@dataclass(frozen=True, slots=True)
class Done:
    """A row that ended: the id ``SlotSession.add`` gave it, its response and why it ended."""

    row: int
    tokens: list[int]
    logprobs: list[float]
    reason: TerminalReason


@dataclass(frozen=True, slots=True)
class _Row:
    prompt: int  # index into the session's _Prefixes
    key: int
    sampling: SamplingConfig
    limit: int
    min_length: int  # 0: none
    stop: Any
    eos_id: int  # -1: EOS does not end the row (ignore_eos)


class SlotSession:
    """Continuous batching on ``num_slots`` decode slots: rows are added at any time and each ``step()``
    draws one token for every live row; a row that ends frees its slot for the next queued row that step.

    Rows are admitted in the order they were added. Rows may differ in sampling distribution (one draw per
    distribution per step), max tokens, stop check and EOS handling. The slot batch starts as small as the
    queue allows and grows up to ``num_slots`` when more rows wait; the cache's capacity grows with the
    longest prompt + max tokens admitted; both start again from nothing whenever the session runs idle. Not
    thread-safe: one thread adds, steps and aborts.
    """

    def __init__(self, model: Any, *, eos_id: int, num_slots: int) -> None:
        self.eos_id, self.num_slots = eos_id, max(_MIN_ROWS, num_slots)
        self._rows: dict[int, _Row] = {}
        self._queue: deque[int] = deque()
        self._next = 0
        self._prefixes = _Prefixes()
        self._dec = _SlotDecoder(model, 0, 0)  # the model's weights now, copied: later updates do not reach it
        self._state: _Slots | None = None
        self._aborted: list[Done] = []  # queued rows aborted since the last step
        self._capacity = self._steps = 0  # longest prompt + max tokens, and max tokens, of any row added

    @property
    def idle(self) -> bool:
        """No row queued or live."""
        return not self._queue and not self._aborted and (self._state is None or self._state.num_live == 0)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def live(self) -> int:
        return 0 if self._state is None else self._state.num_live

    def add(self, prompt: Sequence[int], key: int, sampling: SamplingConfig, *, max_tokens: int | None = None,
            min_length: int | None = None, stop_check: Any = None, ignore_eos: bool = False) -> int:
        """Queue one row; returns its id (0, 1, ... in the order added). ``max_tokens`` caps it below
        ``sampling.max_tokens``; ``min_length`` keeps it decoding (response cut at its first end) that long."""
        limit = sampling.max_tokens if max_tokens is None else min(int(max_tokens), sampling.max_tokens)
        row = self._next
        self._next += 1
        self._capacity = max(self._capacity, len(prompt) + sampling.max_tokens)
        self._steps = max(self._steps, sampling.max_tokens)
        self._rows[row] = _Row(prompt=self._prefixes.add(prompt), key=int(key), sampling=sampling, limit=limit,
                               min_length=int(min_length or 0), stop=stop_check,
                               eos_id=-1 if ignore_eos else self.eos_id)
        self._queue.append(row)
        return row

    def abort(self, rows: Any) -> None:
        """End ``rows`` now: live ones with TerminalReason.ABORT and what they drew, queued ones empty (reported
        by the next ``step()``)."""
        stop = set(rows)
        if not stop:
            return
        if self._queue and stop & set(self._queue):
            kept = []
            for r in self._queue:
                if r in stop:
                    self._prefixes.release(self._rows.pop(r).prompt)
                    self._aborted.append(Done(r, [], [], _REASONS[_ABORT]))
                else:
                    kept.append(r)
            self._queue = deque(kept)
        if self._state is not None:
            self._aborted.extend(self._state.abort(stop, self._rows))

    @torch.no_grad()
    def step(self, abort: Any = None) -> list[Done]:
        """One token for every live row; the rows that ended. Queued rows take the slots free after the draw,
        their prompts prefilled in this step's forward (rows queued while none is live are admitted first, on a
        prefill of their own).

        ``abort()``, when given, is called after the draw and names rows to end at once (as ``abort``).
        """
        if self._state is None or self._state.num_live == 0:
            self._admit()  # nothing decodes: no forward to share
        state, done = self._state, self._aborted
        self._aborted = []
        if state is None or state.num_live == 0:
            return done
        live = state.row >= 0
        tok, lp = state.draw(live)
        done.extend(state.record(live, tok, lp, self._rows))
        if abort is not None:
            self.abort(abort())
            done.extend(self._aborted)
            self._aborted = []
        if not self._queue:
            keep = state.maybe_compact()
            if keep is not None:
                self._dec.keep(keep)
                tok = tok[keep]
        active = state.row >= 0
        decoding = bool(active.any())
        prompts = self._prefixes.plan(self._prefixes_of_next()) if self._queue else []
        if prompts:  # the capacity _admit grows to: the prompts' rotary positions
            self._dec.resize(self._dec.slots, self._capacity)
        if decoding or prompts:
            logits, prefilled = self._dec.step(tok if decoding else None, active if decoding else None,
                                               [list(self._prefixes.prompt[u]) for u in prompts])
            if decoding:
                state.logits = torch.where(active[:, None], logits, state.logits)
            self._prefixes.store(prompts, prefilled)
        self._admit()
        if not self._queue and not self._aborted and state.num_live == 0:
            self._reset()  # idle: the next rows start from an empty batch sized for them
        return done

    def _prefixes_of_next(self) -> list[int]:
        """The prompts of the queued rows the next ``_admit`` takes (the free slots, then the growth it asks for)."""
        free = int((self._state.row < 0).sum())
        count = free + self._growth(free)
        return [self._rows[r].prompt for r in itertools.islice(self._queue, count)]

    def _growth(self, free: int) -> int:
        """Slots to add for the queued rows that ``free`` slots do not take (up to ``num_slots``)."""
        return max(0, min(self.num_slots - self._dec.slots, len(self._queue) - free))

    def _reset(self) -> None:
        """Back to no slots and no capacity (the weights stay): a long prompt or max_tokens once served does not
        widen every later step's attention in a long-lived session."""
        self._state = None
        self._capacity = self._steps = 0
        self._dec.clear()

    def _admit(self) -> None:
        """Queued rows into free slots (lowest slot first), growing the batch when rows wait."""
        if not self._queue:
            return
        need_cap, need_steps = self._capacity, self._steps
        if self._state is None:
            batch = max(_MIN_ROWS, min(self.num_slots, len(self._queue)))
            self._dec.resize(batch, need_cap)
            self._state = _Slots(batch, need_steps, self._dec.vocab)
        state, dec = self._state, self._dec
        grow = self._growth(int((state.row < 0).sum()))
        if grow > 0 or need_cap > dec.capacity:
            dec.resize(dec.slots + grow, need_cap)
        state.resize(dec.slots, need_steps)
        state.admit(self._queue, self._rows, self._prefixes, dec)


class _Slots:
    """Which row each batch slot holds, its token count, pending logits, stream and response so far."""

    def __init__(self, batch: int, steps: int, vocab: int) -> None:
        self.row = torch.full((batch,), -1, dtype=torch.long)  # row in each slot, -1 = free
        self.t = torch.zeros(batch, dtype=torch.long)  # tokens drawn so far by the slot's row
        self.logits = torch.zeros((batch, vocab), dtype=torch.float32)
        self.limit = torch.zeros(batch, dtype=torch.long)
        self.min_len = torch.zeros(batch, dtype=torch.long)
        self.eos = torch.full((batch,), -1, dtype=torch.long)
        self.first_end = torch.zeros(batch, dtype=torch.long)  # response end (EOS / stop) before min_len
        self.reason = torch.zeros(batch, dtype=torch.long)
        self.u = torch.zeros((batch, steps), dtype=torch.float64)  # the row's uniform for each token
        self.tokens = torch.zeros((batch, steps), dtype=torch.long)
        self.logps = torch.zeros((batch, steps), dtype=torch.float32)
        self.sampling: list[SamplingConfig | None] = [None] * batch
        self.stop: list[Any] = [None] * batch
        self.special = 0  # live rows with a stop check or a min length (the slow record path)
        self.num_live = 0
        self.configs: dict[SamplingConfig, int] = {}  # live rows per distribution (_distribution)

    _PER_SLOT = ("row", "t", "logits", "limit", "min_len", "eos", "first_end", "reason", "u", "tokens", "logps")

    def resize(self, batch: int, steps: int) -> None:
        more, wider = batch - self.row.numel(), steps - self.u.shape[1]
        if more <= 0 and wider <= 0:
            return
        for name in self._PER_SLOT:
            x = getattr(self, name)
            if wider > 0 and x.dim() == 2 and name != "logits":
                x = torch.nn.functional.pad(x, [0, wider])
            if more > 0:
                x = torch.cat([x, torch.full((more, *x.shape[1:]), -1 if name == "row" else 0, dtype=x.dtype)])
            setattr(self, name, x)
        self.sampling += [None] * max(0, more)
        self.stop += [None] * max(0, more)

    def admit(self, queue: deque, rows: dict[int, _Row], prefixes: "_Prefixes", dec: _SlotDecoder) -> None:
        free = (self.row < 0).nonzero().flatten().tolist()
        taken = [queue.popleft() for _ in range(min(len(free), len(queue)))]
        if not taken:
            return
        slots = torch.tensor(free[: len(taken)], dtype=torch.long)
        streams = uniforms([rows[r].key for r in taken], self.u.shape[1])
        for slot, r in zip(slots.tolist(), taken):
            spec = rows[r]
            ks, vs, logits = prefixes.take(spec.prompt, dec)
            dec.load(slot, ks, vs)
            self.logits[slot] = logits
            dist = self.sampling[slot] = _distribution(spec.sampling)
            self.stop[slot] = spec.stop
            self.special += spec.stop is not None or spec.min_length > 0
            self.configs[dist] = self.configs.get(dist, 0) + 1
        self.num_live += len(taken)
        specs = [rows[r] for r in taken]
        self.row[slots] = torch.tensor(taken, dtype=torch.long)
        self.t[slots] = 0
        self.limit[slots] = torch.tensor([s.limit for s in specs], dtype=torch.long)
        self.min_len[slots] = torch.tensor([s.min_length for s in specs], dtype=torch.long)
        self.eos[slots] = torch.tensor([s.eos_id for s in specs], dtype=torch.long)
        self.first_end[slots] = _NEVER
        self.reason[slots] = _LENGTH
        self.u[slots] = streams

    def draw(self, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A token and its log-prob for every slot (free slots draw too, ignored), each row under its distribution."""
        configs = list(self.configs)
        u = self.u[torch.arange(self.row.numel()), self.t.clamp(max=self.u.shape[1] - 1)]
        if len(configs) == 1:
            sampling = configs[0]
            return _draw(self.logits, sampling, None if sampling.greedy else u)
        tok = torch.zeros(self.row.numel(), dtype=torch.long)
        lp = torch.zeros(self.row.numel(), dtype=torch.float32)
        for sampling in configs:
            idx = torch.tensor([s for s, c in enumerate(self.sampling) if c == sampling and bool(live[s])])
            tok[idx], lp[idx] = _draw(self.logits[idx], sampling, None if sampling.greedy else u[idx])
        return tok, lp

    def record(self, live: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor, rows: dict[int, _Row]) -> list[Done]:
        slots = live.nonzero().flatten()
        t, tok = self.t[slots], tok[slots]
        self.tokens[slots, t], self.logps[slots, t] = tok, lp[slots]
        t = t + 1
        self.t[slots] = t
        if not self.special:  # the common case: a row ends at EOS or its limit
            eos = tok == self.eos[slots]
            done = eos | (t >= self.limit[slots])
            if not bool(done.any()):
                return []
            self.reason[slots[eos]] = _EOS
            self.first_end[slots[eos]] = t[eos]
            return self._finish(slots[done], t[done], rows)
        open_ = self.first_end[slots] > t  # response still running (not ended before min_len)
        ended = (tok == self.eos[slots]) & open_
        for j in (open_ & ~ended).nonzero().flatten().tolist():
            slot = int(slots[j])
            check = self.stop[slot]
            if check is not None and check(self.tokens[slot, : t[j]].tolist()):
                ended[j] = True
                self.reason[slot] = _STOP
        self.reason[slots[ended & (tok == self.eos[slots])]] = _EOS
        self.first_end[slots[ended]] = t[ended]
        done = (t >= self.limit[slots]) | ((self.first_end[slots] <= t) & (t >= self.min_len[slots]))
        return self._finish(slots[done], t[done], rows)

    def abort(self, stop: set, rows: dict[int, _Row]) -> list[Done]:
        hit = ((self.row >= 0) & torch.isin(self.row, torch.tensor(sorted(stop), dtype=torch.long))).nonzero()
        hit = hit.flatten()
        if not hit.numel():
            return []
        self.reason[hit] = _ABORT
        self.first_end[hit] = torch.minimum(self.first_end[hit], self.t[hit])
        return self._finish(hit, self.t[hit], rows)

    def _finish(self, slots: torch.Tensor, t: torch.Tensor, rows: dict[int, _Row]) -> list[Done]:
        lengths = torch.minimum(t, self.first_end[slots]).tolist()  # cut what followed an early end
        out = []
        for slot, k, r, why in zip(slots.tolist(), lengths, self.row[slots].tolist(), self.reason[slots].tolist()):
            out.append(Done(r, self.tokens[slot, :k].tolist(), self.logps[slot, :k].tolist(), _REASONS[why]))
            spec = rows.pop(r)
            self.special -= spec.stop is not None or spec.min_length > 0
            dist = self.sampling[slot]
            self.configs[dist] -= 1
            if not self.configs[dist]:
                del self.configs[dist]
            self.sampling[slot] = self.stop[slot] = None
        self.row[slots] = -1
        self.num_live -= len(out)
        return out

    def maybe_compact(self) -> torch.Tensor | None:
        """Slots to keep once the queue is drained and at most _COMPACT_AT of them are live, else None."""
        live = self.row >= 0
        num_live, size = int(live.sum()), live.numel()
        if size <= _MIN_ROWS or num_live > _COMPACT_AT * size:
            return None
        keep = live.nonzero().flatten()
        if keep.numel() < _MIN_ROWS:  # pad with free slots: a one-row batch would change the kernels
            keep = torch.cat([keep, (~live).nonzero().flatten()[: _MIN_ROWS - keep.numel()]]).sort().values
        for name in self._PER_SLOT:
            setattr(self, name, getattr(self, name)[keep])
        idx = keep.tolist()
        self.sampling = [self.sampling[i] for i in idx]
        self.stop = [self.stop[i] for i in idx]
        return keep


class _Prefixes:
    """Each distinct queued prompt's keys, values and last logits: prefilled _PREFILL_PROMPTS prompts at a time
    (the one a row needs, then the next waiting ones in the order they were first added) when a row of one is
    admitted, and forgotten once every queued row of that prompt has been (a long-lived session keeps nothing of
    the prompts it served)."""

    def __init__(self) -> None:
        self.index: dict[tuple[int, ...], int] = {}
        self.prompt: dict[int, tuple[int, ...]] = {}
        self.left: dict[int, int] = {}  # queued rows of each prompt
        self.waiting: deque[int] = deque()  # distinct prompts with queued rows and no prefill yet, in order
        self.ready: dict[int, Prefilled] = {}
        self._next = 0

    def add(self, prompt: Sequence[int]) -> int:
        key = tuple(prompt)
        u = self.index.get(key)
        if u is None:
            u = self.index[key] = self._next
            self._next += 1
            self.prompt[u], self.left[u] = key, 0
            self.waiting.append(u)
        self.left[u] += 1
        return u

    def release(self, u: int) -> None:
        """A queued row of prompt ``u`` left without being admitted."""
        self.left[u] -= 1
        if self.left[u] == 0:
            if u in self.waiting:
                self.waiting.remove(u)
            self._forget(u)

    def plan(self, needed: Sequence[int]) -> list[int]:
        """The prompts to prefill now for rows about to be admitted: those of ``needed`` not prefilled yet, then
        the next waiting ones in the order first added, _PREFILL_PROMPTS in all (more when more are needed);
        none when every needed one is ready. ``store`` takes their prefill."""
        batch = list(dict.fromkeys(u for u in needed if u not in self.ready))
        if not batch:
            return []
        for u in batch:
            self.waiting.remove(u)
        while self.waiting and len(batch) < _PREFILL_PROMPTS:
            batch.append(self.waiting.popleft())
        return batch

    def store(self, batch: Sequence[int], prefilled: Sequence[Prefilled]) -> None:
        self.ready.update(zip(batch, prefilled))

    def take(self, u: int, dec: _SlotDecoder) -> Prefilled:
        """Prompt ``u``'s prefill for one of its rows (prefilled now, with the next waiting ones, if not yet)."""
        if u not in self.ready:
            batch = self.plan([u])
            self.store(batch, dec.prefill([list(self.prompt[v]) for v in batch]))
        self.left[u] -= 1
        entry = self.ready[u]
        if self.left[u] == 0:
            self._forget(u)
        return entry

    def _forget(self, u: int) -> None:
        del self.index[self.prompt.pop(u)], self.left[u]
        self.ready.pop(u, None)
