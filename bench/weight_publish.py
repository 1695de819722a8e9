"""Weight publish benchmark: latency and bytes per transport and option, against the machine's limits.

Run:  OMP_NUM_THREADS=1 python bench/weight_publish.py [--dir /tmp] [--params 0.5e9] [--repeats 2]

What it measures (median of ``--repeats`` runs, tiny model: 5 runs):
- the limits: disk write bandwidth (write + fsync of 512 MiB on the publish
  file system) and memcpy bandwidth (torch copy of 256 MiB);
- for the quickstart's built-in model (fp32, 0.80M params) and a synthetic
  ~0.5B-parameter bf16 state dict (Qwen2.5-0.5B shapes): publish latency and
  bytes moved for in-process, disk and torch.distributed gloo (to a receiver
  subprocess), with encodings raw / bf16 / fp8 and delta publish after one
  small optimizer step (fp32 master weights, AdamW-like first step: every
  weight moves by lr = 1e-6, then the bf16 wire copy is compared);
- the receive side for disk (verify every shard's sha256, parse, decode).

"vs disk" and "vs memcpy" are the publish throughput (bytes moved / publish
latency) divided by those limits. Nothing here is estimated: every number is
measured on this machine when the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlctl.contracts.types import WeightUpdate  # noqa: E402
from rlctl.engine.transports.disk import DiskTransport  # noqa: E402
from rlctl.engine.transports.inprocess import InProcessTransport  # noqa: E402
from rlctl.engine.weight_sync import Broadcaster, Receiver, SyncOptions  # noqa: E402
from rlctl.models.fingerprint import fingerprint  # noqa: E402

MiB = 1 << 20
LR = 1e-6


def median_s(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


# -- limits --------------------------------------------------------------------------------


def disk_write_bw(directory: Path, total: int = 512 * MiB, repeats: int = 3) -> float:
    chunk = os.urandom(64 * MiB)
    path = directory / "bw.bin"

    def once() -> None:
        with open(path, "wb", buffering=0) as f:
            for _ in range(total // len(chunk)):
                f.write(chunk)
            os.fsync(f.fileno())
        path.unlink()

    seconds, _ = median_s(once, repeats)
    return total / seconds


def memcpy_bw(size: int = 256 * MiB, repeats: int = 5) -> float:
    src = torch.empty(size, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds, _ = median_s(lambda: dst.copy_(src), repeats)
    return size / seconds


# -- states --------------------------------------------------------------------------------


def tiny_states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The quickstart's built-in model (fp32) before and after one AdamW step at lr 1e-6."""
    from rlctl.config.models import ModelConfig
    from rlctl.models.load import build_tiny

    model = build_tiny(ModelConfig(), vocab_size=99, pad_id=0, bos_id=1, eos_id=2, seed=0)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0).step()
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return before, after


def qwen_like_shapes(target_params: float) -> dict[str, tuple[int, ...]]:
    """Qwen2.5-0.5B-like shapes (hidden 896, MLP 4864, vocab 151936); layers scaled to ``target_params``."""
    hidden, inter, vocab, kv = 896, 4864, 151936, 128
    per_layer = {"q_proj.weight": (hidden, hidden), "k_proj.weight": (kv, hidden), "v_proj.weight": (kv, hidden),
                 "o_proj.weight": (hidden, hidden), "gate_proj.weight": (inter, hidden),
                 "up_proj.weight": (inter, hidden), "down_proj.weight": (hidden, inter),
                 "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
    layer_params = sum(torch.Size(s).numel() for s in per_layer.values())
    layers = max(1, round((target_params - vocab * hidden) / layer_params))
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in per_layer.items()})
    return shapes


def synthetic_states(target_params: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """bf16 wire states before/after one step on fp32 master weights (every weight moves by +-lr)."""
    g = torch.Generator().manual_seed(0)
    before, after = {}, {}
    for name, shape in qwen_like_shapes(target_params).items():
        if len(shape) == 1:
            master = torch.ones(shape)
            step = torch.zeros(shape)  # norms get no update here, as in the tiny test
        else:
            master = torch.randn(shape, generator=g).mul_(0.02)
            step = torch.randint(0, 2, shape, generator=g, dtype=torch.int8).float().mul_(2 * LR).sub_(LR)
        before[name] = master.to(torch.bfloat16)
        after[name] = master.add_(step).to(torch.bfloat16)
        del master, step
    return before, after


def as_update(version: int, state: dict[str, torch.Tensor]) -> WeightUpdate:
    return WeightUpdate(version=version, state_dict=state, fingerprint=fingerprint(state))


# -- cases ---------------------------------------------------------------------------------


def run_local(kind: str, encoding: str, delta: bool, before: WeightUpdate, after: WeightUpdate, root: Path,
              repeats: int) -> dict[str, Any]:
    """Publish ``after`` (as a delta on ``before`` when ``delta``) ``repeats`` times; time publish and receive."""
    publish_times, receive_times, report = [], [], None
    for r in range(repeats):
        directory = root / f"{kind}-{encoding}-{delta}-{r}"
        transport = DiskTransport(directory) if kind == "disk" else InProcessTransport()
        broadcaster = Broadcaster(transport, SyncOptions(encoding=encoding, delta=delta))
        base_state = None
        if delta:
            broadcaster.publish(before)
            base_state = Receiver(transport).receive().state_dict
        started = time.perf_counter()
        report = broadcaster.publish(WeightUpdate(version=2, state_dict=after.state_dict,
                                                  fingerprint=after.fingerprint))
        publish_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        got = Receiver(transport).receive(base=base_state,
                                          base_fingerprint=fingerprint(base_state) if base_state else None)
        receive_times.append(time.perf_counter() - started)
        assert got.fingerprint == report.manifest.fingerprint
        del got, base_state
        shutil.rmtree(directory, ignore_errors=True)
    assert report is not None
    return {"bytes": report.num_bytes, "full_bytes": report.full_bytes, "publish_s": statistics.median(publish_times),
            "receive_s": statistics.median(receive_times)}


_PEER = """
import json, sys, time
from rlctl.engine.transports.distributed import DistTransport
from rlctl.engine.weight_sync import Receiver
t = DistTransport(rank=1, world_size=2, master_port=int(sys.argv[1]), timeout_s=600, bind_addr="127.0.0.1")
t.connect()
for _ in range(int(sys.argv[2])):
    started = time.perf_counter()
    u = Receiver(t).receive()
    print(json.dumps({"receive_s": time.perf_counter() - started, "fingerprint": u.fingerprint}), flush=True)
"""


def run_gloo(update: WeightUpdate, repeats: int) -> dict[str, Any]:
    from rlctl.engine.transports.distributed import DistTransport

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(port), str(repeats)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        sender = DistTransport(rank=0, world_size=2, master_port=port, timeout_s=600, bind_addr="127.0.0.1")
        sender.connect()
        broadcaster = Broadcaster(sender)
        times, report = [], None
        for r in range(repeats):
            started = time.perf_counter()
            report = broadcaster.publish(WeightUpdate(version=r + 1, state_dict=update.state_dict,
                                                      fingerprint=update.fingerprint))
            times.append(time.perf_counter() - started)
        out, _ = peer.communicate(timeout=600)
        received = [json.loads(line) for line in out.strip().splitlines()]
        assert all(r["fingerprint"] == update.fingerprint for r in received)
        sender.close()
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    assert report is not None
    return {"bytes": report.num_bytes, "full_bytes": report.full_bytes, "publish_s": statistics.median(times),
            "receive_s": statistics.median(r["receive_s"] for r in received)}


TINY_CASES = [(k, o, 5) for k in ("inprocess", "disk") for o in ("raw", "bf16", "fp8", "bf16+delta")] + [
    ("gloo", "raw", 5)]


def synthetic_cases(repeats: int) -> list[tuple[str, str, int]]:
    """The 0.5B cases; the slow CPU encodings (fp8, delta) run once to keep the bench under ~3 minutes."""
    return [("inprocess", "raw", repeats), ("disk", "raw", repeats), ("disk", "fp8", 1), ("disk", "bf16+delta", 1),
            ("gloo", "raw", 1)]


def cases(before: WeightUpdate, after: WeightUpdate, root: Path, plan: list[tuple[str, str, int]]) -> list[tuple]:
    rows = []
    for kind, option, repeats in plan:
        if kind == "gloo":
            rows.append((kind, option, run_gloo(after, repeats)))
            continue
        encoding, delta = option.split("+")[0], option.endswith("+delta")
        rows.append((kind, option, run_local(kind, encoding, delta, before, after, root, repeats)))
    return rows


def table(title: str, rows: list[tuple], disk_bw: float, mem_bw: float) -> None:
    print(f"\n{title}")
    head = f"{'transport':<10} {'option':<11} {'MiB moved':>10} {'vs full':>8} {'publish s':>10} {'MiB/s':>8} " \
           f"{'vs disk':>8} {'vs memcpy':>9} {'receive s':>10}"
    print(head)
    print("-" * len(head))
    full = {}
    for kind, option, r in rows:
        if option in ("raw", "bf16", "fp8"):
            full[(kind, option)] = r["bytes"]
    for kind, option, r in rows:
        reference = full.get((kind, option.split("+")[0]), r["full_bytes"])
        rate = r["bytes"] / r["publish_s"]
        print(f"{kind:<10} {option:<11} {r['bytes'] / MiB:>10.2f} {r['bytes'] / reference:>8.3f} "
              f"{r['publish_s']:>10.4f} {rate / MiB:>8.0f} {rate / disk_bw:>8.2f} {rate / mem_bw:>9.3f} "
              f"{r['receive_s']:>10.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="File system to publish on (default: tmp).")
    parser.add_argument("--params", type=float, default=0.5e9, help="Size of the synthetic state dict.")
    parser.add_argument("--repeats", type=int, default=3, help="Repeats for the synthetic state (median).")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="rlctl-bench-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        disk_bw, mem_bw = disk_write_bw(root), memcpy_bw()
        print(f"limits on this machine: disk write+fsync {disk_bw / MiB:.0f} MiB/s ({root}), "
              f"memcpy {mem_bw / MiB:.0f} MiB/s")
        before, after = (as_update(v, s) for v, s in zip((1, 2), tiny_states()))
        n = sum(t.numel() for t in after.state_dict.values())
        table(f"tiny model (quickstart built-in, fp32, {n / 1e6:.2f}M params), median of 5",
              cases(before, after, root, TINY_CASES), disk_bw, mem_bw)
        del before, after
        before, after = (as_update(v, s) for v, s in zip((1, 2), synthetic_states(args.params)))
        n = sum(t.numel() for t in after.state_dict.values())
        table(f"synthetic state dict ({n / 1e9:.3f}B params, bf16, Qwen2.5-0.5B shapes); raw: median of "
              f"{args.repeats}, fp8 / delta / gloo: 1 run", cases(before, after, root, synthetic_cases(args.repeats)),
              disk_bw, mem_bw)
        print(f"\n(bf16 of a bf16 state is the same bytes as raw, so the synthetic table has no bf16 row. "
              f"Delta = after one step at lr {LR:g} on fp32 master weights; 'vs full' compares with the full "
              f"publish of the same encoding. Total bench time {time.perf_counter() - t0:.0f}s.)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
