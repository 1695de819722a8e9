"""Reward throughput (samples/s) vs reward workers, for a grader that sleeps 50 ms per sample.

    OMP_NUM_THREADS=1 python bench/reward_workers.py [--samples 64] [--repeats 3] [--sandbox] [--math-helper]

Rows: in-process (reward.workers=1, today's path), then ProcessRewardPool with 1 and 2
workers, interleaved, median of --repeats. Ratios are to the in-process row of the same run.
Acceptance: 2 workers >= 1.8x the single-worker throughput. A sleeping grader measures the
pool's overhead and parallelism, not the CPU (a sleep needs none). --sandbox adds rows for the
real "code" reward (one bwrap jail per sample), which is CPU-bound, so on a shared 2-core box
its speed-up is bounded by the idle cores. --math-helper times the sympy helper's start
(once per process, and after each timeout) plain vs in its bwrap jail, and one check.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

from rlctl import RewardResult, SamplingConfig, TerminalReason, Trajectory
from rlctl.engine.reward_pool import ProcessRewardPool


class SleepGrader:
    name = "sleep"
    version = "sleep@1"

    def __init__(self, delay_s: float = 0.05) -> None:
        self.delay_s = delay_s

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        time.sleep(self.delay_s)
        return RewardResult(total=1.0, components={"sleep": 1.0}, grader_version=self.version)


def code_grader():
    from rlctl_rewards.code import CodeOptions, CodeReward

    return CodeReward(CodeOptions())


def samples(n: int, text: str) -> list[Trajectory]:
    return [Trajectory.create(
        id=f"p{i}/0", prompt_id=f"p{i}", group_index=0, dataset_version="d", policy_version=0, tokenizer_hash="t",
        prompt_tokens=(1,), response_tokens=(2,), response_text=text, action_mask=(1,), behavior_logprobs=(-0.1,),
        sampling_config=SamplingConfig(max_tokens=4), terminal_reason=TerminalReason.EOS, rollout_started_at=0.0,
    ) for i in range(n)]


def math_helper(repeats: int) -> None:
    import subprocess
    from pathlib import Path

    from rlctl_rewards import symbolic

    parent = str(Path(symbolic.__file__).resolve().parent.parent)
    jailed = symbolic.helper_command(parent)
    plain = jailed[jailed.index("--remount-ro") + 2:]
    env = symbolic._HELPER_ENV | {"PYTHONPATH": parent}
    times: dict[str, list[float]] = {"plain (empty env)": [], "bwrap jail": []}
    for _ in range(repeats):
        for name, argv in (("plain (empty env)", plain), ("bwrap jail", jailed)):
            t = time.perf_counter()
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/")
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            times[name].append(time.perf_counter() - t)
            proc.kill()
            proc.wait()
    base = statistics.median(times["plain (empty env)"])
    print(f"\nsympy helper start to 'ready' (imports sympy), median of {repeats}")
    for name, ts in times.items():
        print(f"{name:<20}{statistics.median(ts):>8.3f} s{statistics.median(ts) / base:>8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sandbox", action="store_true", help="also time the real code reward")
    parser.add_argument("--math-helper", action="store_true", help="only time the sympy helper's start")
    args = parser.parse_args()
    if args.math_helper:
        math_helper(args.repeats)
        return
    cases = [("sleep 50 ms", partial(SleepGrader), "x", "r")]
    if args.sandbox:
        cases.append(("code (bwrap)", code_grader, "def f(x):\n    return x + 1", "assert f(1) == 2"))
    for title, factory, text, ref in cases:
        trajs, refs = samples(args.samples, text), [ref] * args.samples
        inproc = factory()
        pools = {n: ProcessRewardPool(factory, n, timeout_s=60) for n in (1, 2)}
        times: dict[str, list[float]] = {"in-process": [], "pool, 1 worker": [], "pool, 2 workers": []}
        try:
            for _ in range(args.repeats):  # interleaved, so load changes hit every row alike
                t = time.perf_counter()
                results = [inproc.score(tr, r) for tr, r in zip(trajs, refs)]
                times["in-process"].append(time.perf_counter() - t)
                assert all(r.error_code is None and r.total == 1.0 for r in results), results[0]
                for n, pool in pools.items():
                    t = time.perf_counter()
                    results = pool.score(trajs, refs)
                    times[f"pool, {n} worker{'s' if n > 1 else ''}"].append(time.perf_counter() - t)
                    assert all(r.error_code is None and r.total == 1.0 for r in results), results[0]
        finally:
            for pool in pools.values():
                pool.close()
        base = args.samples / statistics.median(times["in-process"])
        one = args.samples / statistics.median(times["pool, 1 worker"])
        print(f"\n{title}: {args.samples} samples, median of {args.repeats}")
        print(f"{'grading':<18}{'samples/s':>11}{'x in-process':>14}{'x 1 worker':>12}")
        for name, ts in times.items():
            rate = args.samples / statistics.median(ts)
            print(f"{name:<18}{rate:>11.1f}{rate / base:>14.2f}{rate / one:>12.2f}")


if __name__ == "__main__":
    main()
