"""``rlctl runs list|show``: the registry's runs, with provenance, last metrics and checkpoints."""

from __future__ import annotations

import datetime as dt
from typing import Optional

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
    from rlctl.ops.reconcile import reconcile_stale_runs

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
    from rlctl.ops.reconcile import reconcile_stale_runs

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
