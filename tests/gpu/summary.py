"""The one table tests/gpu/run.sh prints at its end: each step, its budget, its wall time, passed or failed,
and the numbers it measured, read back from the files the steps wrote under $OUT.

What this is: a reader of run.sh's outputs (setup.txt, pytest.txt, quickstart.json, fsdp_ledger.txt,
trl_step_time.txt); it writes the table to $OUT/summary.txt as well. What this is not: a judge of the numbers
(the bench scripts and the gpu tests hold the thresholds), nor something that runs a step.

    python tests/gpu/summary.py OUT "setup 25 4 0" "imports 25 9 0" "cuda 15 1 3" "pytest 150 - -" ...
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Callable

RESULTS = {"0": "passed", "124": "timed out", "137": "timed out (killed)", "-": "not run"}


def _text(out: Path, name: str) -> str:
    path = out / name
    return path.read_text(errors="replace") if path.is_file() else ""


def _last(pattern: str, text: str) -> re.Match[str] | None:
    found = list(re.finditer(pattern, text, re.M))
    return found[-1] if found else None


def setup(out: Path) -> str:
    m = _last(r"^installed (\d+) wheels", _text(out, "setup.txt"))
    return f"{m[1]} wheels from .whl/ + rlctl (editable)" if m else ""


def imports(out: Path) -> str:
    text = _text(out, "setup.txt")
    found = {name: _last(rf"^{name}\s+(\S+)\s+(image|site|repo)\s", text) for name in ("torch", "transformers", "trl")}
    return ", ".join(f"{k} {m[1]} ({m[2]})" for k, m in found.items() if m)


def cuda(out: Path) -> str:
    m = _last(r"^(?:device: (.*)|no CUDA device: ([^;]*).*)$", _text(out, "setup.txt"))
    return (m[1] or m[2]) if m else ""


def pytest(out: Path) -> str:
    m = _last(r"^=*\s*(\d+ (?:passed|failed|skipped|error).*?)\s*=*$", _text(out, "pytest.txt"))
    return m[1] if m else ""


def quickstart(out: Path) -> str:
    try:
        data = json.loads(_text(out, "quickstart.json"))
    except json.JSONDecodeError:
        return ""
    metrics = data.get("last_metrics") or {}
    shown = ", ".join(f"{k} {metrics[k]:.4g}" for k in ("reward_mean", "loss", "step_time_s", "logprob_mismatch_max")
                      if k in metrics)
    return f"run {(data.get('run') or {}).get('status')}, wall {data.get('wall_s') or 0:.1f} s; last step: {shown}"


def fsdp_ledger(out: Path) -> str:
    text = _text(out, "fsdp_ledger.txt")
    step, peak = _last(r"^step time: median (\S+ s)", text), _last(r"^peak memory .*\): (\S.*)$", text)
    ratios = {m[1]: m[2] for m in re.finditer(r"^(rollout|train|sync) .* (\d+\.\d+)$", text, re.M)}
    parts = [f"step {step[1]} median" if step else "", f"peak {peak[1]}" if peak else "",
             "ledger/measured " + ", ".join(f"{k} {v}" for k, v in ratios.items()) if ratios else ""]
    return "; ".join(p for p in parts if p)


def trl_step_time(out: Path) -> str:
    m = _last(r"^\S+: .*?(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\d+/\d+\s*$", _text(out, "trl_step_time.txt"))
    return f"rlctl {m[1]} s, TRL {m[2]} s per step: TRL/rlctl {m[3]}x" if m else ""


NUMBERS: dict[str, Callable[[Path], str]] = {
    "setup": setup, "imports": imports, "cuda": cuda, "pytest": pytest, "quickstart": quickstart,
    "fsdp_ledger": fsdp_ledger, "trl_step_time": trl_step_time,
}


def table(out: Path, rows: list[str]) -> str:
    lines = [f"{'step':<15}{'budget s':>9}{'wall s':>8}  {'result':<20}numbers", "-" * 100]
    budget = wall = 0
    for row in rows:
        name, b, w, rc = row.split()
        result = "no CUDA device" if name == "cuda" and rc == "3" else RESULTS.get(rc, f"failed (exit {rc})")
        numbers = NUMBERS.get(name, lambda _: "")(out) if rc != "-" else ""
        lines.append(f"{name:<15}{b:>9}{w:>8}  {result:<20}{numbers}")
        budget += int(b)
        wall += int(w) if w != "-" else 0
    lines.append(f"{'total':<15}{budget:>9}{wall:>8}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    text = table(out, argv[1:])
    print(text)
    (out / "summary.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
