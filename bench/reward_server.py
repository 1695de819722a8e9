"""`rlctl serve reward` throughput (samples/s): concurrent clients batched into shared forward passes, or not.

    OMP_NUM_THREADS=1 python bench/reward_server.py [--clients 8] [--requests 16] [--repeats 3]

Builds a small reward model locally (Llama sequence classifier, hidden 256, 4 layers, character
tokenizer; rlctl.models.reward_model), starts two real `rlctl serve reward` processes on
127.0.0.1 -- one batching (--max-batch-rows 64, --batch-wait-ms 5), one not (--max-batch-rows 1)
-- and sends --clients threads x --requests single-sample /score requests to each (what
reward.workers grader processes do, one (prompt, response) per call, ~60 tokens each); then one
client sending the same number of samples 64 per request (what the trainer's score_batch sends).
Repeats are interleaved; the table reports medians, and the ratio to the unbatched server of the
same run. Also reports the mean forward-pass size each server saw (the batching server's figure
covers both of its rows).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import REPO  # noqa: E402  (one thread, offline; must precede torch)


def start(model: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "rlctl.cli.app", "serve", "reward", "--model", str(model),
                             "--port", "0", *flags], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, cwd=REPO)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, line.split("listening on ", 1)[1].split()[0]


def pair(k: int, i: int) -> tuple[str, str]:
    a, b = (k * 7 + i) % 90 + 10, (k * 3 + i * 5) % 90 + 10
    return f"Compute {a} plus {b}, then explain: {a}+{b}=", f"{a + b}. Because {a} and {b} add to {a + b}."


def burst(url: str, clients: int, requests: int, per_request: int = 1) -> float:
    """Samples/s for ``clients`` threads each sending ``requests`` /score calls of ``per_request`` samples."""
    from rlctl.serve.client import call_json

    def client(k: int) -> None:
        for i in range(requests):
            pairs = [pair(k, i * per_request + j) for j in range(per_request)]
            answer = call_json(url, "POST", "/score", {"prompt": [p for p, _ in pairs],
                                                       "response": [r for _, r in pairs]}, timeout_s=60)
            assert len(answer["scores"]) == per_request

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return clients * requests * per_request / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=16, help="per client")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    from rlctl.models.reward_model import build_tiny_reward_model
    from rlctl.serve.client import call_json

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_reward_model(Path(tmp) / "rm", hidden_size=256, num_layers=4, num_heads=4,
                                        intermediate_size=1024)
        servers = {"unbatched (--max-batch-rows 1)": start(model, "--max-batch-rows", "1"),
                   "batched (--max-batch-rows 64)": start(model, "--max-batch-rows", "64", "--batch-wait-ms", "5")}
        try:
            for _, url in servers.values():
                burst(url, 2, 2)  # warm up
            one = "1 client, 64 samples/request"  # what a trainer's score_batch sends, to the batching server
            rates: dict[str, list[float]] = {name: [] for name in [*servers, one]}
            for _ in range(args.repeats):
                for name, (_, url) in servers.items():
                    rates[name].append(burst(url, args.clients, args.requests))
                total = args.clients * args.requests
                rates[one].append(burst(servers["batched (--max-batch-rows 64)"][1], 1, max(1, total // 64), 64))
            stats = {name: call_json(url, "GET", "/server_info", timeout_s=10)["rlctl"]
                     for name, (_, url) in servers.items()}
            stats[one] = stats["batched (--max-batch-rows 64)"]
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    base = statistics.median(rates["unbatched (--max-batch-rows 1)"])
    print(f"{args.clients} clients x {args.requests} single-sample requests, median of {args.repeats} (interleaved)")
    print(f"{'server':<32} {'samples/s':>10} {'ratio':>7} {'rows/forward':>13}")
    for name, values in rates.items():
        s = stats[name]
        shown = "" if name == one else f"{s['rows'] / max(s['batches'], 1):>13.2f}"
        print(f"{name:<32} {statistics.median(values):>10.1f} {statistics.median(values) / base:>6.2f}x {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
