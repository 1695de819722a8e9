"""Predict staleness and waiting before an overlapped run: a small discrete-event simulation.

What this is: ``predict()``. It replays the overlapped loop's own rules
(rlctl.engine.overlap, rlctl.engine.queue) on a virtual clock: W rollout
workers claim ``chunk`` prompts at a time through the queue's admission gate
(capacity, and a draw key at most ``max_ahead`` steps ahead of the learner's
version), pick up the newest weights at each call, and take as long as the
longest of the chunk's G x chunk responses (batched decoding) times the
per-token decode time, plus a fixed per-call cost; the learner takes B groups
(in batch order for sync / one_step_off, oldest-first with the Δv bound for
async, dropping stale ones) and trains for ``learn_s``. Response lengths are
drawn from the workload's distribution (empirical lengths from a smoke run,
or a heavy-tailed one), so the tail of the length distribution drives both
the stragglers and the staleness.

Contention: with ``cores`` set, the busy activities (every worker call in
flight and the learner's step) share that much compute by processor sharing:
each progresses at min(1, cores / number busy) of its isolated speed. Without
it every activity runs at full speed in parallel (separate devices). On the
local placement with worker threads (``cluster.rollout_workers=threads``) a
small model's decode and train steps are Python-bound, so they share one GIL:
``cores=1`` (``contention_cores``); worker processes and a Ray placement share
the machine's (the cluster's) CPUs.
Sharing that keeps every activity busy slows all of them alike, so it moves
the predicted throughput (steps/s) much more than Δv; Δv moves when the
sharing is uneven, which this model does not capture (the benchmark prints
how far the prediction misses).

Output: mean / P95 Δv of trained groups, the drop rate, each side's waiting
share, and steps per second. ``rlctl dryrun`` prints it for overlapped
configs and bench/async_vs_sync.py prints it next to the measured values.

What this is not: a model of memory bandwidth, of GPU kernels, or of
weight-transfer cost beyond ``sync_s``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence


@dataclass(frozen=True, slots=True, kw_only=True)
class SimParams:
    mode: str  # sync | one_step_off | async
    max_staleness: int
    prompts_per_step: int  # B
    group_size: int  # G
    workers: int
    chunk: int  # prompts per worker call
    capacity: int  # groups buffered + in flight
    learn_s: float  # learner compute per step (incl. the learner's logprob pass)
    token_s: float  # decode time per generated position of one batched call
    call_s: float = 0.0  # fixed cost per worker call (prefill, scoring, queue append)
    sync_s: float = 0.0  # weight publish per step (learner side)
    steps: int = 200
    cores: float | None = None  # compute shared by all busy activities (processor sharing); None = no contention
    min_groups: int | None = None  # partial rollout: a step proceeds with this many ready groups; None = all B

    @property
    def max_ahead(self) -> int:
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)


@dataclass(frozen=True, slots=True)
class Prediction:
    staleness_mean: float
    staleness_p95: float
    drop_rate: float
    learner_wait_share: float
    rollout_wait_share: float
    steps_per_s: float
    groups_per_s: float  # trained groups per second (steps_per_s x B unless partial rollout trains fewer)
    utilisation: float  # rollout demand / learner capacity: > 1 means rollout-bound


def predict(params: SimParams, lengths: Callable[[random.Random], int], seed: int = 0) -> Prediction:
    """Simulate ``params.steps`` learner steps; ``lengths(rng)`` draws one response length in tokens."""
    sim = _Simulation(params, lengths, random.Random(seed))
    for w in range(params.workers):
        sim.start_worker(w)
    sim.try_learn()
    while sim.step < params.steps and sim.jobs:
        sim.advance()
        sim.try_learn()
        for w in range(params.workers):
            if w not in sim.jobs:
                sim.start_worker(w)
        sim.try_learn()
    return sim.prediction()


class _Simulation:
    """The learner and W rollout workers on a virtual clock (see the module docstring)."""

    def __init__(self, params: SimParams, lengths: Callable[[random.Random], int], rng: random.Random) -> None:
        self.p, self.lengths, self.rng = params, lengths, rng
        self.now = 0.0
        self.jobs: dict[int, list] = {}  # -1 = the learner's step, w >= 0 = worker w's call: [work left, keys, version]
        self.version = self.step = self.next_key = 0
        self.pending: dict[int, int] = {}  # key -> policy version of its group
        self.idle_since: dict[int, float] = {w: 0.0 for w in range(params.workers)}
        self.rollout_wait = self.learner_wait = self.learner_idle_since = 0.0
        self.trained: list[int] = []
        self.dropped = 0
        self.demand: list[float] = []

    def admissible(self, key: int) -> bool:
        occupancy = len(self.pending) + sum(len(j[1]) for w, j in self.jobs.items() if w >= 0)
        return occupancy < self.p.capacity and key // self.p.prompts_per_step <= self.version + self.p.max_ahead

    def start_worker(self, w: int) -> None:
        p, keys = self.p, []
        while len(keys) < p.chunk and self.admissible(self.next_key):
            keys.append(self.next_key)
            self.next_key += 1
        if not keys:
            return
        self.rollout_wait += self.now - self.idle_since.pop(w)
        longest = max(self.lengths(self.rng) for _ in range(len(keys) * p.group_size))
        duration = p.call_s + p.token_s * longest
        self.demand.append(duration / len(keys))
        self.jobs[w] = [duration, keys, self.version]

    def try_learn(self) -> None:
        p, b = self.p, self.p.prompts_per_step
        if -1 in self.jobs or self.step >= p.steps:
            return
        batch = self._ready_batch() if p.mode == "async" or p.min_groups else \
            [k for k in range(self.step * b, (self.step + 1) * b)]
        if batch is None or any(k not in self.pending for k in batch):
            return
        self.learner_wait += self.now - self.learner_idle_since
        for k in batch:
            self.trained.append(self.version - self.pending.pop(k))
        self.jobs[-1] = [p.learn_s + p.sync_s, [], self.version]

    def _ready_batch(self) -> list[int] | None:
        """async and partial rollout: drop what is beyond the bound, then the oldest ready keys (None: too few)."""
        p, b = self.p, self.p.prompts_per_step
        below = None if p.mode == "async" else (self.step + 1) * b  # one_step_off: only batches up to this step's
        bound = p.max_staleness if p.mode == "async" else p.max_ahead
        for k in [k for k, v in self.pending.items() if self.version - v > bound and (below is None or k < below)]:
            self.pending.pop(k)
            self.dropped += 1
        fresh = sorted(k for k in self.pending if below is None or k < below)
        return fresh[:b] if len(fresh) >= (p.min_groups or b) else None

    def advance(self) -> None:
        """Run the clock to the next job's end (processor sharing over ``cores``) and retire that job."""
        rate = 1.0 if self.p.cores is None else min(1.0, self.p.cores / len(self.jobs))
        done = min(self.jobs, key=lambda j: self.jobs[j][0])
        dt = self.jobs[done][0] / rate
        self.now += dt
        for job in self.jobs.values():
            job[0] -= dt * rate
        _, keys, v = self.jobs.pop(done)
        if done >= 0:
            for k in keys:
                self.pending[k] = v
            self.idle_since[done] = self.now
        else:
            self.step += 1
            self.version += 1
            self.learner_idle_since = self.now

    def prediction(self) -> Prediction:
        p, total = self.p, max(self.now, 1e-9)
        ordered = sorted(self.trained)
        per_group = sum(self.demand) / len(self.demand) if self.demand else 0.0
        return Prediction(
            staleness_mean=sum(self.trained) / len(self.trained) if self.trained else 0.0,
            staleness_p95=float(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]) if ordered else 0.0,
            drop_rate=self.dropped / max(1, self.dropped + len(self.trained)),
            learner_wait_share=self.learner_wait / total,
            rollout_wait_share=self.rollout_wait / (total * p.workers),
            steps_per_s=self.step / total,
            groups_per_s=len(self.trained) / total,
            utilisation=(per_group * p.prompts_per_step / p.workers) / max(p.learn_s + p.sync_s, 1e-9),
        )


def empirical(lengths: Sequence[int]) -> Callable[[random.Random], int]:
    """Draw response lengths from observed ones (e.g. a smoke run's)."""
    values = list(lengths) or [1]
    return lambda rng: rng.choice(values)


def pareto(alpha: float, minimum: int, maximum: int) -> Callable[[random.Random], int]:
    """Heavy-tailed lengths: P(L > x) = (minimum / x)^alpha, cut at ``maximum`` (the max_tokens budget)."""
    return lambda rng: min(maximum, int(math.ceil(minimum * rng.paretovariate(alpha))))


def contention_cores(config: object) -> float | None:
    """The compute rollout and learner share, by placement (an assumption, printed with the prediction).

    Local with worker threads: 1 (they and the learner share one GIL; right for Python-bound small models
    on CPU). Local with worker processes (``cluster.rollout_workers``) and Ray: the CPUs the processes may
    use (``cluster.num_cpus`` on Ray, else this machine's).
    """
    import os

    from rlctl.placement.processes import use_processes

    cluster = config.cluster
    if cluster.backend == "ray":  # separate processes: the CPUs they may use
        return float(cluster.num_cpus or os.cpu_count() or 1)
    if config.mode != "sync" and use_processes(config):
        return float(os.cpu_count() or 1)
    return 1.0  # threads of one process


def from_config(config: object, *, learn_s: float, token_s: float, call_s: float = 0.0, sync_s: float = 0.0,
                steps: int = 200, cores: float | None = None) -> SimParams:
    """SimParams for a run config and measured per-step / per-token times."""
    c = config
    b = c.algo.prompts_per_step
    workers = c.cluster.num_rollout_workers
    ahead = {"sync": 0, "one_step_off": 1}.get(c.mode, c.staleness.max_staleness)
    return SimParams(mode=c.mode, max_staleness=c.staleness.max_staleness, prompts_per_step=b,
                     group_size=c.algo.group_size, workers=workers,
                     chunk=c.staleness.rollout_chunk or max(1, -(-b // workers)),
                     capacity=c.staleness.queue_capacity or (ahead + 1) * b, learn_s=learn_s, token_s=token_s,
                     call_s=call_s, sync_s=sync_s, steps=steps, cores=cores,
                     min_groups=math.ceil(c.staleness.partial_fraction * b) if c.staleness.partial_fraction < 1
                     else None)


@dataclass(frozen=True, slots=True)
class RunPrediction:
    """A prediction for a run config plus the inputs it was made from (printed next to it)."""

    prediction: Prediction
    params: SimParams
    lengths: str  # how response lengths were drawn


def length_tail(config: Any, plugins: Any) -> tuple[float, int] | None:
    """The Pareto length tail the run's rollout options impose (LengthTailOptions), or None."""
    from rlctl.config.load import validate_options
    from rlctl.contracts.roles import LengthTailOptions

    options = validate_options(plugins.get("rollout_backend", config.rollout.backend).options,
                               config.rollout.options, "rollout.options")
    return options.length_tail() if isinstance(options, LengthTailOptions) else None


def predict_for_run(config: Any, smoke_metrics: dict[str, float], steps: int = 200,
                    cores: float | None | str = "placement", *, tail: tuple[float, int] | None = None,
                    **overrides: Any) -> RunPrediction:
    """Predict from a sync smoke step's timings (T_r for one whole batch, T_l, T_s) and response lengths.

    Per-token time is T_r / longest response (batched decoding runs as long as
    its longest row), per worker call; the learner's step is T_l (D_lag comes
    from the training forward, rlctl.engine.step, so overlap adds no pass).
    Lengths follow ``tail`` (the rollout's imposed Pareto tail: ``length_tail``)
    when given, else a spread between the smoke step's mean and max response length. ``cores``:
    "placement" = ``contention_cores(config)``; None = no contention.
    ``overrides`` replace SimParams fields (e.g. ``workers=1, chunk=B`` for
    the plain synchronous loop's single engine).
    """
    m = smoke_metrics
    longest = max(1.0, m.get("response_length_max", 1.0))
    mean = max(1.0, m.get("response_length_mean", longest))
    if tail is not None:
        alpha, low = tail
        draw, how = pareto(alpha, low, config.rollout.max_tokens), f"Pareto(alpha={alpha:g}, min={low})"
        # the smoke batch decoded to its longest tail draw, not to its longest (trained) response:
        # per-token time is T_r over the typical longest of B x G draws
        rows = config.algo.prompts_per_step * config.algo.group_size
        rng = random.Random(1)
        longest = float(sorted(max(draw(rng) for _ in range(rows)) for _ in range(51))[25])
    else:
        lo, hi = int(mean), int(longest)
        draw = (lambda rng: rng.randint(lo, hi)) if hi > lo else (lambda rng: lo)
        how = f"uniform {lo}..{hi} tokens (smoke step mean..max)"
    shared = contention_cores(config) if cores == "placement" else cores
    token_s = m.get("T_r", 0.0) / longest
    params = from_config(config, learn_s=m.get("T_l", 0.0), token_s=token_s, sync_s=m.get("T_s", 0.0),
                         steps=steps, cores=shared)
    params = replace(params, **overrides)
    return RunPrediction(prediction=predict(params, draw), params=params, lengths=how)
