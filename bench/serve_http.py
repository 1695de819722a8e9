"""`rlctl serve rollout` and `rlctl serve reward`: requests/s and p99 latency, before vs after the HTTP stack change.

    OMP_NUM_THREADS=1 python bench/serve_http.py --baseline /work/base [--requests 200] [--repeats 5]

Starts four real servers, each pinned to CPU 0 (`taskset -c 0`): the rollout and reward servers of this
checkout (uvicorn + Starlette) and of ``--baseline``, a checkout of the code before it (http.server),
run with this interpreter and ``PYTHONPATH=BASELINE:BASELINE/plugins``. Same models for both: a
random-weight tiny Qwen2 with the character tokenizer (bench/_shapes.py "tiny") and the tiny reward model
(rlctl.models.reward_model). The load generator runs on CPU 1 (when there is one): 1 or 16 client
threads, each on one keep-alive connection, each sending ``--requests`` requests back to back --
/generate of 4 prompt tokens and 4 greedy new tokens, /score of one short pair, and GET /health (the
HTTP path alone: no model work, an empty answer). Rows are interleaved
(before, after, before, ...) over ``--repeats``; the table shows medians, the after/before ratio, and
p99 latency over every request of every repeat, and the mean rows per engine batch (server counters). ``--batch-wait-ms`` (default 0) is given to every
server, so the HTTP path, not the batching window, is what a 1-client row measures.
Without ``--baseline`` only this checkout's servers are measured.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import REPO  # noqa: E402  (one thread, offline; must precede torch)

# row name -> (server kind, method, path, JSON body); "health" is the HTTP path alone (no model work, no body)
ROWS = {"rollout": ("rollout", "POST", "/generate", {"input_ids": [1, 20, 21, 22],
                                                    "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}),
        "reward": ("reward", "POST", "/score", {"prompt": "Compute 12 plus 30: ", "response": "42"}),
        "health": ("rollout", "GET", "/health", None)}


def start(root: Path, kind: str, model: Path, batch_wait_ms: float | None, extra: Sequence[str] = (),
          log: Path | None = None, cpu: int = 0) -> tuple[subprocess.Popen, int]:
    """`rlctl serve KIND` of the checkout ``root`` pinned to ``cpu`` (taskset, one thread), started and listening:
    (process, port). ``batch_wait_ms`` None keeps the server's default; ``extra`` are more flags. Its stderr goes
    to ``log`` (discarded without one); when it does not start, the error quotes the log's last lines."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{root}{os.pathsep}{root / 'plugins'}")
    cmd = ["taskset", "-c", str(cpu), sys.executable, "-m", "rlctl.cli.app", "serve", kind, "--model", str(model),
           "--port", "0", *([] if batch_wait_ms is None else ["--batch-wait-ms", str(batch_wait_ms)]), *extra]
    with open(log or os.devnull, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=root)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait(30)
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:]) if log else ""
        raise SystemExit(f"{kind} server of {root} did not start ({' '.join(cmd[3:])}): {line!r}\n{tail}")
    return proc, int(line.split("listening on ", 1)[1].split()[0].rsplit(":", 1)[1])


def burst(port: int, row: str, clients: int, requests: int) -> tuple[float, list[float]]:
    """(requests/s, every latency) for ``clients`` threads on their own keep-alive connection."""
    _, method, path, body = ROWS[row]
    data = None if body is None else json.dumps(body).encode()
    latencies: list[list[float]] = [[] for _ in range(clients)]
    failures: list[str] = []

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            for _ in range(requests):
                started = time.perf_counter()
                conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                latencies[k].append(time.perf_counter() - started)
                if resp.status != 200:
                    failures.append(f"{path} answered {resp.status}")
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if failures:
        raise SystemExit(f"requests failed: {failures[:3]}")
    return clients * requests / wall, [x for row in latencies for x in row]


def batches(port: int) -> tuple[int, int]:
    """(engine batches, rows) the server has run so far (its /server_info counters)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/server_info")
        info = json.loads(conn.getresponse().read())["rlctl"]
    finally:
        conn.close()
    return info["batches"], info["rows"]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, help="A checkout of the code before (its servers are the 'before' rows).")
    p.add_argument("--requests", type=int, default=200, help="Requests per client per row.")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch-wait-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {1})  # the clients on CPU 1, the servers on CPU 0
    from _shapes import build_model_dir

    from rlctl.models.reward_model import build_tiny_reward_model

    versions = {"after": REPO, **({"before": args.baseline.resolve()} if args.baseline else {})}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"rollout": build_model_dir("tiny", Path(tmp))[0], "reward": build_tiny_reward_model(Path(tmp) / "rm")}
        servers = {(v, k): start(root, k, models[k], args.batch_wait_ms) for v, root in versions.items() for k in models}
        rows: dict[tuple[str, int, str], list[float]] = {}
        lat: dict[tuple[str, int, str], list[float]] = {}
        sizes: dict[tuple[str, int, str], list[int]] = {}
        try:
            for (v, kind), (_, port) in servers.items():
                burst(port, kind, 2, 20)  # warm up
            for _ in range(args.repeats):
                for kind in ROWS:
                    for clients in (1, 16):
                        for v in sorted(versions, reverse=True):  # before, then after
                            port = servers[(v, ROWS[kind][0])][1]
                            b0, r0 = batches(port)
                            rate, times = burst(port, kind, clients, args.requests)
                            b1, r1 = batches(port)
                            rows.setdefault((kind, clients, v), []).append(rate)
                            sizes.setdefault((kind, clients, v), []).extend([b1 - b0, r1 - r0])
                            lat.setdefault((kind, clients, v), []).extend(times)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    print(f"{args.requests} requests per client, median of {args.repeats} interleaved repeats; servers on CPU 0, "
          f"clients on CPU 1; --batch-wait-ms {args.batch_wait_ms:g}")
    print(f"{'row':<8} {'clients':>7} {'version':<8} {'req/s':>9} {'x before':>9} {'p99 ms':>8} {'x before':>9} "
          f"{'rows/batch':>11}")
    for (kind, clients, v), rates in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "before")):
        base = rows.get((kind, clients, "before"))
        rate, tail = statistics.median(rates), p99(lat[(kind, clients, v)]) * 1000
        ratio = f"{rate / statistics.median(base):>8.2f}x" if base else f"{'':>9}"
        tail_ratio = f"{tail / (p99(lat[(kind, clients, 'before')]) * 1000):>8.2f}x" if base else ""
        counts = sizes[(kind, clients, v)]
        per_batch = f"{sum(counts[1::2]) / sum(counts[0::2]):.2f}" if sum(counts[0::2]) else "-"
        print(f"{kind:<8} {clients:>7} {v:<8} {rate:>9.1f} {ratio} {tail:>8.2f} {tail_ratio or '':>9} {per_batch:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
