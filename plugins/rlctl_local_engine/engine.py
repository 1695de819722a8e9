"""The local rollout engine: a Hugging Face causal LM sampled in-process on torch.

What this is: the RolloutBackend for CPU and small models. It generates the G
samples of each prompt together in one batch, returns full Trajectory records,
and applies weight updates all-or-nothing (the new version is served only when
every tensor is loaded and the fingerprint matches).

Schedulers (option ``scheduler``): ``batch`` (default) runs each forward's rows
together until its longest row ends; ``slots`` (slots.py) runs the whole call on
``max_batch_sequences`` decode slots, refilling a slot as soon as its row ends,
with a random stream per row keyed by (seed, call counter, request index, sample
index), so the samples do not depend on the slot count and ``state()`` (the call
counter) is all a resumed run needs.

Resumable state: ``state()`` / ``load_state()`` carry the sampler's torch
generator and the call counter (used in trajectory ids), so a resumed run
draws exactly the samples an uninterrupted one would (rlctl.contracts.roles
StatefulRollout).

Sharing a GPU with a colocated learner (options ``kv_cache_budget``,
``release_memory``, ``offload_weights``): rows per forward are capped so
the KV cache of one forward stays within the budget; a chunked call returns
the same trajectories, in the same order, as an unchunked one (greedy
decoding gives the same tokens; sampled tokens differ because the draws are
taken in a different batch shape; trajectory ids carry a per-forward counter).
After each call the allocator's cached blocks can go back to the device and
the weights can wait in host memory until the next call.

Sessions (``open_session``): continuous batching that takes requests at any
time and hands back each row as it ends, on a copy of the weights served when
it opened (``rlctl serve rollout``'s continuous scheduler; ``stream``, the
continuous rollout of overlapped runs).

What this is not: a serving engine. For production rollout use the sglang
plugin; ``rlctl serve rollout`` puts this engine behind the same HTTP API.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Collection, Mapping, Sequence

import torch

from rlctl import ConfigError, RoleError, RolloutRequest, Trajectory, WeightUpdate
from rlctl.contracts.types import RolloutContext
from rlctl.kit import (
    apply_update, fault_site, fingerprint, fmt_bytes, from_hf_config, kv_budget_rows, kv_cache_bytes, load_policy,
    placed, resolve_device,
)
from rlctl_local_engine.options import LocalEngineOptions
from rlctl_local_engine.sampler import fast_path_supported, sample
from rlctl_local_engine.slots import SlotSession, sample_slots
from rlctl_local_engine.streams import row_key


class LocalEngine:
    """RolloutBackend over an in-process torch model."""

    def __init__(self, ctx: RolloutContext, options: LocalEngineOptions | None = None) -> None:
        self.options = options or LocalEngineOptions()
        self.device = resolve_device(self.options.device, "rollout.options.device")
        self.kv_budget_bytes = self._budget_bytes()  # before loading: a fraction on CPU fails fast
        self.model, self.tokenizer = load_policy(ctx.model_dir)
        self.model.to(self.device)
        self._offloaded = False
        self.tokenizer_hash = ctx.tokenizer_hash
        self.policy_version = ctx.policy_version
        self.fingerprint = fingerprint(self.model.state_dict())
        if self.options.scheduler == "slots" and not fast_path_supported(self.model):
            raise ConfigError(f"rollout.options.scheduler: slots needs an fp32 Llama/Qwen2-shaped model (the static-"
                              f"cache fast path); {ctx.model_dir} is not one",
                              "set rollout.options.scheduler: batch for this model")
        self._seed = ctx.seed
        self._generator = torch.Generator(device=self.device).manual_seed(ctx.seed)
        self._tail_generator = torch.Generator().manual_seed(ctx.seed + 7919)
        self._calls = 0

    def generate(self, requests: Sequence[RolloutRequest], *,
                 cancelled: Callable[[], Collection[int]] | None = None, ignore_eos: bool = False) -> list[Trajectory]:
        """Trajectories for ``requests``, in order.

        ``cancelled()``, when given, is polled between decode steps and names
        requests (indices into ``requests``) to stop: their rows end with
        TerminalReason.ABORT at once, so nobody's work keeps a core busy.
        ``ignore_eos``: EOS does not end a row (kept in its response; rows run to max_tokens or a stop string).
        """
        fault_site("rollout.generate", requests=len(requests))
        if not requests:
            return []
        cap = self.rows_per_forward(requests)
        self._reload_weights()
        try:
            if self.options.scheduler == "slots":  # one call: the slots bound the rows decoded at once
                whole = [(k, req, range(req.group_size)) for k, req in enumerate(requests)]
                return self._generate_chunk(whole, cancelled, slots=cap, ignore_eos=ignore_eos)
            out: list[Trajectory] = []
            for chunk in _chunks(requests, cap):
                out.extend(self._generate_chunk(chunk, cancelled, ignore_eos=ignore_eos))
            return out
        finally:
            self._release()

    def rows_per_forward(self, requests: Sequence[RolloutRequest]) -> int:
        """max_batch_sequences, capped by the KV budget for this call's longest prompt + max_tokens."""
        cap = self.options.max_batch_sequences
        if self.kv_budget_bytes is None:
            return cap
        tokens = max(len(r.prompt_tokens) for r in requests) + max(r.sampling.max_tokens for r in requests)
        shape, elem = self._kv_shape()
        fit = kv_budget_rows(shape, tokens, elem, self.kv_budget_bytes)
        if fit < 1:
            row = kv_cache_bytes(shape, 1, tokens, elem)
            raise RoleError(f"rollout.options.kv_cache_budget {fmt_bytes(self.kv_budget_bytes)} is too small for one "
                            f"row: {tokens} tokens (longest prompt + max_tokens) x {shape.num_layers} layers x 2 x "
                            f"{shape.num_kv_heads} KV heads x {shape.head_dim} dims x {elem} B = {fmt_bytes(row)}",
                            f"raise kv_cache_budget to at least {row} bytes, or lower rollout.max_tokens")
        return min(cap, fit)

    def _kv_shape(self) -> tuple[Any, int]:
        """The model's shape for the KV formula and its cache element size (the sampler's cache dtype)."""
        cfg = self.model.config
        shape = from_hf_config(cfg.to_dict(), name=getattr(cfg, "model_type", "model"), source="rollout model config")
        return shape, self.model.get_input_embeddings().weight.element_size()

    def _budget_bytes(self) -> int | None:
        budget = self.options.kv_cache_budget
        if budget is None or isinstance(budget, int):
            return budget
        if self.device.type != "cuda":
            raise ConfigError(f"rollout.options.kv_cache_budget {budget} is a fraction of the device's memory, and "
                              f"the engine runs on {self.device} (only CUDA devices report their memory)",
                              "give the budget in bytes on CPU (e.g. kv_cache_budget: 2GiB), or set "
                              "rollout.options.device: cuda")
        _, total = torch.cuda.mem_get_info(self.device)
        return int(budget * total)

    def _release(self) -> None:
        """After a call: weights to host memory (offload_weights) and cached blocks back to the device."""
        if self.device.type != "cuda":
            return  # on CPU both are no-ops (documented): the weights already live in host memory
        if self.options.offload_weights:
            self._offload_weights()
        if self.options.release_memory or self.options.offload_weights:
            torch.cuda.empty_cache()

    def _offload_weights(self) -> None:
        """Copy every parameter and buffer to host memory and drop the device copies (the module keeps its
        tensors' identities: ``.data`` is repointed, as ``swap_in`` does)."""
        _move(self.model, torch.device("cpu"))
        self._offloaded = True

    def _reload_weights(self) -> None:
        if self._offloaded:
            _move(self.model, self.device)
            self._offloaded = False

    def _generate_chunk(self, chunk: Sequence[tuple[int, RolloutRequest, range]],
                        cancelled: Callable[[], Collection[int]] | None = None, slots: int | None = None,
                        ignore_eos: bool = False) -> list[Trajectory]:
        """One forward over ``chunk``: (index into the call's requests, request, its group indices here); with
        ``slots``, the whole call on that many decode slots, row (k, g) drawing from stream (seed, call, k, g)."""
        sampling = chunk[0][1].sampling
        if any(r.sampling != sampling for _, r, _ in chunk):
            raise RoleError("one generate() call mixes sampling configs", "split the requests by sampling config")
        self._calls += 1
        started = time.time()
        prompts = [list(r.prompt_tokens) for _, r, gs in chunk for _ in gs]
        stop_check = self._stop_check(sampling.stop) if sampling.stop else None
        abort = _chunk_abort(chunk, cancelled)
        tail = self._tail_lengths(len(prompts), sampling.max_tokens)
        eos_id = -1 if ignore_eos else self.tokenizer.eos_token_id
        with placed(self.device):  # prompt, cache and sampling tensors live beside the model
            if slots is not None:
                keys = [row_key(self._seed, self._calls, k, g) for k, _, gs in chunk for g in gs]
                result = sample_slots(self.model, prompts, keys, sampling, eos_id=eos_id,
                                      num_slots=slots, stop_check=stop_check, abort=abort, min_lengths=tail)
            else:
                result = sample(self.model, prompts, sampling, eos_id=eos_id,
                                pad_id=self.tokenizer.pad_token_id, generator=self._generator,
                                stop_check=stop_check, abort=abort, min_lengths=tail)
        texts = self.tokenizer.batch_decode(result.tokens, skip_special_tokens=True)
        rows = [(req, g) for _, req, groups in chunk for g in groups]
        return [self._trajectory(req, g, result.tokens[i], result.logprobs[i], result.reasons[i], texts[i], started,
                                 self._calls, self.policy_version)
                for i, (req, g) in enumerate(rows)]

    def _trajectory(self, req: RolloutRequest, g: int, tokens: Sequence[int], logprobs: Sequence[float],
                    reason: Any, text: str, started: float, call: int, version: int) -> Trajectory:
        return Trajectory.create(
            id=f"{req.prompt_id}/v{version}/c{call}/{g}", prompt_id=req.prompt_id, group_index=g,
            dataset_version=req.dataset_version, policy_version=version,
            tokenizer_hash=self.tokenizer_hash, prompt_tokens=tuple(req.prompt_tokens),
            response_tokens=tuple(tokens), response_text=text, action_mask=(1,) * len(tokens),
            behavior_logprobs=tuple(logprobs), sampling_config=req.sampling, terminal_reason=reason,
            rollout_started_at=started)

    def supports_sessions(self) -> bool:
        """Whether ``open_session`` can run this model (the fp32 Llama/Qwen2 fast path)."""
        return fast_path_supported(self.model)

    def open_session(self, num_slots: int) -> "EngineSession":
        """Continuous batching on ``num_slots`` decode slots over the weights served now (EngineSession)."""
        if not self.supports_sessions():
            raise RoleError("continuous batching needs an fp32 Llama/Qwen2-shaped model (the static-cache fast "
                            "path)", "serve this model with --scheduler batch")
        self._reload_weights()
        self._calls += 1
        return EngineSession(self, num_slots)

    def stream(self, requests: Sequence[RolloutRequest], on_group: Callable[[int, list[Trajectory]], None],
               more: Callable[[int, bool], Any] | None = None) -> None:
        """Continuous rollout for an overlapped run's worker: EngineSessions kept full across weight versions.

        Request k's G samples go to ``on_group(k, trajectories)`` as soon as its last row ends (k counts the
        requests in the order taken: ``requests``, then what ``more`` returned). ``more(free_slots, idle)`` is
        asked for further requests whenever no row waits for a slot and a group's worth of slots is free (again
        once more slots are free, or when nothing is left to decode: ``idle``, when it may wait a moment). It
        returns requests (maybe none); a WeightUpdate, which is loaded at once: the rows in flight finish on the
        session of the weights they started with while new requests go to a session of the new ones; or None to
        stop asking. Returns once nothing is live or queued and ``more`` gave nothing while idle. Needs
        ``supports_sessions()``.
        """
        slots = self.rows_per_forward(requests) if requests else self.options.max_batch_sequences
        sessions = [self.open_session(slots)]  # the last takes new requests; earlier ones finish their rows
        pending: list[list[Trajectory | None]] = []
        owner: dict[tuple[int, int], int] = {}  # (session number, row) -> request index

        def take(batch: Sequence[RolloutRequest]) -> None:
            for req in batch:
                owner.update(((sessions[-1]._number, row), len(pending)) for row in sessions[-1].add(req))
                pending.append([None] * req.group_size)

        take(requests)
        group = max((r.group_size for r in requests), default=1)
        asking, refused_at = more is not None, -1  # free slots when more() last gave nothing
        try:
            while True:
                live = sum(s.live for s in sessions)
                idle = all(s.idle for s in sessions)
                free = slots - live
                if asking and sessions[-1].queued == 0 and free >= group and (free > refused_at or idle):
                    got = more(free, idle)
                    if got is None:
                        asking = False
                    elif isinstance(got, WeightUpdate):
                        self.update_weights(got)
                        sessions.append(self.open_session(slots))
                        refused_at = -1
                        continue
                    elif got:
                        take(got)
                        group, refused_at = max(r.group_size for r in got), -1
                    elif idle:
                        return  # nothing in flight and nothing more now: the caller comes back
                    else:
                        refused_at = free  # ask again once more slots are free
                if all(s.idle for s in sessions):
                    return
                for session in sessions:
                    for row, trajectory in session.step() if not session.idle else ():
                        k = owner.pop((session._number, row))
                        pending[k][trajectory.group_index] = trajectory
                        if all(t is not None for t in pending[k]):
                            on_group(k, pending[k])
                            pending[k] = []  # handed out: the call keeps nothing of it
                sessions = [s for s in sessions[:-1] if not s.idle] + sessions[-1:]
        finally:
            self._release()

    def _tail_lengths(self, n: int, max_tokens: int) -> list[int] | None:
        """Pareto-distributed decode lengths for the long-tail option (own generator: sampling is unchanged)."""
        alpha = self.options.length_tail_alpha
        if alpha is None:
            return None
        u = torch.rand(n, generator=self._tail_generator).clamp(min=1e-12)
        lengths = (self.options.length_tail_min * u.pow(-1.0 / alpha)).ceil().clamp(max=max_tokens)
        return [int(x) for x in lengths.tolist()]

    def _stop_check(self, stops: Sequence[str]) -> Any:
        def check(tokens: list[int]) -> bool:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            return any(text.endswith(s) for s in stops)

        return check

    def update_weights(self, update: WeightUpdate) -> None:
        """All or nothing: the whole update is checked and staged before the served weights change.

        With offloaded weights the update is staged and swapped in host memory; the next call moves it to the device.
        An open EngineSession goes on with the weights it was opened on.
        """
        self.fingerprint = apply_update(self.model, update)
        self.policy_version = update.version

    def generate_cancellable(self, requests: Sequence[RolloutRequest], cancelled: Callable[[], Collection[int]],
                             ignore_eos: bool = False) -> list[Trajectory]:
        """CancellableRollout: ``generate``, stopping the rows of the requests ``cancelled()`` names."""
        return self.generate(requests, cancelled=cancelled, ignore_eos=ignore_eos)

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """The weights being served (read only: the base a delta weight update is applied to)."""
        return self.model.state_dict()

    def state(self) -> Mapping[str, Any]:
        return {"generator": self._generator.get_state(), "calls": self._calls}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self._generator.set_state(state["generator"])
        self._calls = int(state["calls"])

    def health(self) -> Mapping[str, Any]:
        return {"ok": True, "policy_version": self.policy_version, "fingerprint": self.fingerprint}

    def resident_tensors(self) -> Mapping[str, Sequence[torch.Tensor]]:
        return {"rollout weights": list(self.model.parameters())} if self.model is not None else {}

    def close(self) -> None:
        self.model = None


class EngineSession:
    """Continuous batching over a LocalEngine's weights as they were when it opened (slots.SlotSession).

    What this is: requests go in at any time (``add``), each ``step()`` decodes one token for every live row and
    returns the rows that ended as Trajectory records, at once; ``abort`` ends rows now. Row g of the k-th request
    added draws from stream (seed, session number, k, g): its sample does not depend on what else is decoding.
    The session copies the weights when it opens: after ``update_weights`` it goes on sampling (and labelling its
    trajectories) with the version it opened on, so rows in flight can finish while a new session takes new rows.
    What this is not: thread-safe (one thread adds, steps and aborts).
    """

    def __init__(self, engine: LocalEngine, num_slots: int) -> None:
        self.engine, self._number, self.version = engine, engine._calls, engine.policy_version
        self._session = SlotSession(engine.model, eos_id=engine.tokenizer.eos_token_id, num_slots=num_slots)
        self._rows: dict[int, tuple[RolloutRequest, int, float]] = {}
        self._requests = 0
        self._stops: dict[tuple[str, ...], Any] = {}

    @property
    def idle(self) -> bool:
        return self._session.idle

    @property
    def live(self) -> int:
        return self._session.live

    @property
    def queued(self) -> int:
        return self._session.queued

    def add(self, request: RolloutRequest, *, ignore_eos: bool = False) -> list[int]:
        """Queue the request's ``group_size`` rows; their ids, in group order."""
        fault_site("rollout.generate", requests=1)
        sampling, k = request.sampling, self._requests
        self._requests += 1
        stop = None
        if sampling.stop:
            stop = self._stops.setdefault(tuple(sampling.stop), self.engine._stop_check(sampling.stop))
        started = time.time()
        tail = self.engine._tail_lengths(request.group_size, sampling.max_tokens)  # benchmark work, as generate
        ids = []
        for g in range(request.group_size):
            key = row_key(self.engine._seed, self._number, k, g)
            row = self._session.add(request.prompt_tokens, key, sampling, stop_check=stop, ignore_eos=ignore_eos,
                                    min_length=None if tail is None else tail[g])
            self._rows[row] = (request, g, started)
            ids.append(row)
        return ids

    def abort(self, rows: Collection[int]) -> None:
        self._session.abort(rows)

    def step(self) -> list[tuple[int, Trajectory]]:
        """One decode step; (row id, Trajectory) for each row that ended."""
        engine = self.engine
        with placed(engine.device):
            done = self._session.step()
        out = []
        for d in done:
            req, g, started = self._rows.pop(d.row)
            text = engine.tokenizer.decode(d.tokens, skip_special_tokens=True)
            out.append((d.row, engine._trajectory(req, g, d.tokens, d.logprobs, d.reason, text, started,
                                                          self._number, self.version)))
        return out


def _chunks(requests: Sequence[RolloutRequest], cap: int) -> list[list[tuple[int, RolloutRequest, range]]]:
    """Requests packed in order into forwards of at most ``cap`` rows. A group that fits in one forward is
    kept whole (it starts a new forward when the current one is too full); a larger group fills what is left
    of the current forward and continues in the next ones (its group indices are kept)."""
    out: list[list[tuple[int, RolloutRequest, range]]] = []
    chunk: list[tuple[int, RolloutRequest, range]] = []
    rows = 0
    for k, req in enumerate(requests):
        if chunk and req.group_size <= cap and rows + req.group_size > cap:
            out.append(chunk)
            chunk, rows = [], 0
        start = 0
        while start < req.group_size:
            if rows == cap:
                out.append(chunk)
                chunk, rows = [], 0
            take = min(req.group_size - start, cap - rows)
            chunk.append((k, req, range(start, start + take)))
            rows, start = rows + take, start + take
    if chunk:
        out.append(chunk)
    return out


def _chunk_abort(chunk: Sequence[tuple[int, RolloutRequest, range]],
                 cancelled: Callable[[], Collection[int]] | None) -> Callable[[], list[int]] | None:
    """``cancelled`` (request indices of the whole call) as the rows of ``chunk`` to stop."""
    if cancelled is None:
        return None
    offsets = [0]
    for _, _, groups in chunk:
        offsets.append(offsets[-1] + len(groups))
    where = {k: j for j, (k, _, _) in enumerate(chunk)}  # requests in this chunk (a split one: its rows here)
    return lambda: [row for k in cancelled() if k in where for row in range(offsets[where[k]], offsets[where[k] + 1])]


def _move(model: torch.nn.Module, device: torch.device) -> None:
    """Every parameter and buffer of ``model`` to a fresh copy on ``device`` (the old storage is released)."""
    seen: set[int] = set()  # a tied parameter (embeddings and LM head) is one tensor: move it once
    with torch.no_grad():
        for module in model.modules():
            for param in module._parameters.values():
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    param.data = param.data.to(device, copy=True)
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device, copy=True)
