"""``rlctl runs list|show|compare|plot|evals``: the registry's runs (provenance, last metrics, checkpoints, curves)
and its model evals."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import List, Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt, RegistryOpt, open_registry

app = typer.Typer(help="Runs recorded in the registry.", no_args_is_help=True)


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


@app.command("list")
def list_runs(limit: int = typer.Option(50, "--limit", min=1), status: Optional[str] = typer.Option(None, "--status"),
              registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """List runs, newest first (runs whose process died are marked interrupted/failed first)."""
    from rlctl.lifecycle.reconcile import reconcile_stale_runs

    with open_registry(registry) as reg:
        reconcile_stale_runs(reg)
        runs = reg.list_runs(limit=limit, status=status)
    if json_out:
        _output.print_json({"runs": runs})
        return
    short = lambda h: (h or "")[:8]  # noqa: E731 - full hashes are in `runs show` and --json
    rows = [(r.id, r.name, r.status, _when(r.created_at), short(r.config_hash), r.code_version,
             short(r.dataset_version), short(r.tokenizer_hash), r.seed) for r in runs]
    cols = ["id", "name", "status", "created", "config", "code", "dataset", "tokenizer", "seed"]
    _output.console.print(_output.table(None, cols, rows))


@app.command("show")
def show(run: str = typer.Argument(..., help="Run id (or a unique prefix)."),
         registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Show one run: provenance, config, last metrics, evals, checkpoints and events."""
    from rlctl.lifecycle.reconcile import reconcile_stale_runs

    with open_registry(registry) as reg:
        reconcile_stale_runs(reg)
        rec = reg.get_run(run)
        last = reg.last_metrics(rec.id)
        evals = reg.evals(rec.id)
        events = reg.events(rec.id)
        checkpoints = reg.checkpoints(rec.id)
    if json_out:
        _output.print_json({"run": rec, "last_metrics": {k: {"step": s, "value": v} for k, (s, v) in last.items()},
                            "evals": evals, "events": events, "checkpoints": checkpoints})
        return
    info = [("id", rec.id), ("name", rec.name), ("status", rec.status), ("created", _when(rec.created_at)),
            ("config hash", rec.config_hash), ("code version", rec.code_version),
            ("dataset version", rec.dataset_version), ("tokenizer hash", rec.tokenizer_hash), ("seed", rec.seed),
            ("run dir", rec.run_dir), ("error", rec.error)]
    stopped = [e for e in events if e.kind == "stopped"]
    if stopped:  # a train.stop_rules rule ended it: which rule, after which step, and the checkpoint kept
        info.append(("stopped by", stopped[-1].message))
    _output.console.print(_output.table("run", ["field", "value"], info))
    _output.console.print(_output.table("last metrics", ["metric", "step", "value"],
                                        [(k, s, v) for k, (s, v) in sorted(last.items())]))
    if evals:
        _output.console.print(_output.table("evals", ["split", "n", "start", "final", "diff", "95% CI"], [
            (e.split, e.num_prompts, e.baseline_pass_at_1, e.candidate_pass_at_1, e.diff,
             f"[{e.ci_low:+.3f}, {e.ci_high:+.3f}]") for e in evals]))
    if checkpoints:
        _output.console.print(_output.table("committed checkpoints", ["step", "when", "path"],
                                            [(c.step, _when(c.created_at), c.path) for c in checkpoints]))
    _output.console.print(_output.table("events", ["when", "kind", "message"],
                                        [(_when(e.created_at), e.kind, e.message) for e in events[-10:]]))


@app.command("compare")
def compare(run_a: str = typer.Argument(..., help="First run id (or prefix)."),
            run_b: str = typer.Argument(..., help="Second run id (or prefix)."),
            registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Compare two runs: config differences, provenance, last metrics and latest evals side by side."""
    from rlctl.config.load import config_changes

    with open_registry(registry) as reg:
        a, b = reg.get_run(run_a), reg.get_run(run_b)
        last_a, last_b = reg.last_metrics(a.id), reg.last_metrics(b.id)
        eval_a, eval_b = (reg.evals(a.id) or [None])[-1], (reg.evals(b.id) or [None])[-1]
    config_diff = config_changes(a.config, b.config)
    provenance = [(k, getattr(a, k), getattr(b, k)) for k in
                  ("status", "config_hash", "code_version", "dataset_version", "tokenizer_hash", "seed")]
    metrics = [(k, last_a[k][1], last_b[k][1]) for k in sorted(set(last_a) & set(last_b))]
    if json_out:
        _output.print_json({"runs": [a.id, b.id],
                            "config_diff": [{"key": k, "a": x, "b": y} for k, x, y in config_diff],
                            "provenance": {k: {"a": x, "b": y} for k, x, y in provenance},
                            "last_metrics": {k: {"a": x, "b": y} for k, x, y in metrics},
                            "evals": {"a": eval_a, "b": eval_b}})
        return
    cols = ["", a.id, b.id]
    _output.console.print(_output.table("config differences", cols, config_diff or [("(none)", "", "")]))
    _output.console.print(_output.table("provenance", cols, provenance))
    _output.console.print(_output.table("last metrics", cols, metrics))
    evals = [(f"{e.split} pass@1 start -> final", f"{e.baseline_pass_at_1:.3f} -> {e.candidate_pass_at_1:.3f}")
             if e else ("eval", "none") for e in (eval_a, eval_b)]
    _output.console.print(_output.table("latest eval", cols, [(evals[0][0], evals[0][1], evals[1][1])]))


@app.command("plot")
def plot(run: str = typer.Argument(..., help="Run id (or a unique prefix)."),
         out: Optional[Path] = typer.Option(None, "-o", "--output", help="PNG to write (default: "
                                            "<run dir>/curves.png)."),
         metric: Optional[List[str]] = typer.Option(None, "--metric", help="Plot this metric in a panel of its "
                                                    "own instead of the default panels (repeat for more)."),
         registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """PNG of a run's curves from the registry: training reward, KL to the reference and the dev eval's pass@1
    (eval.every_steps; with eval.grader also its score and the training reward on the same answers)."""
    from rlctl.lifecycle.curves import plot_run

    with open_registry(registry) as reg:
        path, points = plot_run(reg, run, out, metric or [])
    if json_out:
        _output.print_json({"plot": str(path), "points": points})
        return
    drawn = ", ".join(f"{name} {n}" for name, n in points.items() if n) or "no points"
    _output.console.print(f"curves: {path} ({drawn})")


@app.command("evals")
def evals(model: Optional[str] = typer.Option(None, "--model", help="Only this model's evals (its sha256 or a "
                                              "prefix, as `rlctl eval DIR` prints it)."),
          limit: int = typer.Option(50, "--limit", min=1),
          registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """List the model evals (`rlctl eval CHECKPOINT_DIR|HF_DIR`), newest first: the model, the split, pass@k."""
    from rlctl.registry.model_evals import ModelEvalStore

    with open_registry(registry) as reg:
        records = ModelEvalStore(reg).list(model, newest_first=True, limit=limit)
    if json_out:
        _output.print_json({"model_evals": records})
        return
    rows = [(e.id, _when(e.created_at), e.model_hash[:12], e.details.get("kind", ""), e.model_dir, e.split,
             f"{e.num_prompts} x {e.num_samples}", f"{e.temperature:g}",
             ", ".join(f"pass@{k} {v['value'] * 100:.1f}%" for k, v in e.results.items()),
             (e.details.get("eval_grader") or {}).get("version", "correctness reward")) for e in records]
    cols = ["id", "created", "model", "kind", "dir", "split", "prompts x samples", "temp", "results", "graded by"]
    _output.console.print(_output.table(None, cols, rows))
