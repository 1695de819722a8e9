"""The "code" reward's throughput (samples/s), this checkout's harness vs a baseline checkout's, interleaved.

    OMP_NUM_THREADS=1 python bench/code_grader.py --baseline /work/base [--samples 48] [--repeats 7]

Each repeat grades ``--samples`` completions in-process with ``CodeReward`` (one bubblewrap jail per
sample; needs bubblewrap and root, like the reward) once with this checkout's code and once with the
baseline's, each in a fresh interpreter pinned to CPU 0 (``taskset -c 0``; the jails inherit it), in
alternating order. The task mixes the three kinds of test: a value test (``assert f(x) == literal``,
compared outside the jail), an assert-style test and a ``test_*`` function (run by the harness: since
issue 25 in a process the completion cannot reach, calling it over a pipe). Prints the median samples/s
of each and the ratio. Without ``--baseline`` only this checkout is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPLETION = "```python\ndef lcm(a, b):\n    from math import gcd\n    return a * b // gcd(a, b)\n```"
TESTS = ("assert lcm(4, 6) == 12\nassert lcm(3, 5) > 14 and lcm(2, 2) != 3\n"
         "def test_lcm():\n    assert [lcm(k, 2) for k in range(1, 4)] == [2, 2, 6]\n")
WORKER = r"""
import json, sys, time
from rlctl import SamplingConfig, TerminalReason, Trajectory
from rlctl_rewards.code import CodeOptions, CodeReward
text, ref, n = json.loads(sys.argv[1])
traj = Trajectory.create(id="p/0", prompt_id="p", group_index=0, dataset_version="d", policy_version=0,
    tokenizer_hash="t", prompt_tokens=(1,), response_tokens=(2,), response_text=text, action_mask=(1,),
    behavior_logprobs=(-0.1,), sampling_config=SamplingConfig(max_tokens=4), terminal_reason=TerminalReason.EOS,
    rollout_started_at=0.0)
grader = CodeReward(CodeOptions())
assert grader.score(traj, ref).total == 1.0  # warm: the jail check and the first start
started = time.perf_counter()
for _ in range(n):
    result = grader.score(traj, ref)
    assert result.total == 1.0, result.log
print(json.dumps(n / (time.perf_counter() - started)))
"""


def rate(root: Path, samples: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{root}{os.pathsep}{root / 'plugins'}")
    proc = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", WORKER,
                           json.dumps([COMPLETION, TESTS, samples])], capture_output=True, text=True, env=env,
                          cwd=root, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"grading with {root} failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, help="A checkout of the code before (its harness is the 'before' row).")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    versions = {**({"before": args.baseline.resolve()} if args.baseline else {}), "after": REPO}
    rates: dict[str, list[float]] = {name: [] for name in versions}
    for k in range(args.repeats):
        for name in (list(versions) if k % 2 == 0 else list(reversed(versions))):  # alternate who goes first
            rates[name].append(rate(versions[name], args.samples))
    print(f"code reward, {args.samples} samples per run, 3 tests each (value, assert, test_*), median of "
          f"{args.repeats} interleaved runs on CPU 0")
    base = statistics.median(rates["before"]) if "before" in rates else None
    print(f"{'harness':<8} {'samples/s':>10} {'x before':>9}   runs")
    for name, values in rates.items():
        ratio = f"{statistics.median(values) / base:>8.2f}x" if base else ""
        print(f"{name:<8} {statistics.median(values):>10.2f} {ratio:>9}   {', '.join(f'{v:.1f}' for v in values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
