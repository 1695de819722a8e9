"""``rlctl diagnose RUN`` and ``rlctl runbook list|show|check``: thin renderers over rlctl.incidents.diagnose / runbooks."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt, RegistryOpt, open_registry

runbook_app = typer.Typer(help="Incident runbooks (runbooks/*.md): list, read, check against a run.",
                          no_args_is_help=True)


def diagnose(run: str = typer.Argument(..., help="Run id (or a unique prefix)."),
             report: Optional[Path] = typer.Option(None, "--report", help="Write a self-contained HTML report "
                                                   "(metric curves with the flagged windows shaded, and a few of "
                                                   "the run's stored episodes)."),
             episodes: int = typer.Option(3, "--episodes", min=0, help="Stored episodes the HTML report shows."),
             png_dir: Optional[Path] = typer.Option(None, "--png-dir", help="Write one PNG per finding here."),
             registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Walk the diagnosis tree over a run's recorded metrics and events; findings ranked by severity."""
    from rlctl.incidents.diagnose import diagnose as run_diagnosis, render_html, render_pngs
    from rlctl.incidents.runbooks import load_runbooks
    from rlctl.incidents.triggers import history_from

    with open_registry(registry) as reg:
        rec = reg.get_run(run)
        history = history_from(reg.metrics(rec.id), reg.events(rec.id))
    result = run_diagnosis(rec.id, history, load_runbooks())
    written = []
    if report is not None:
        from rlctl.lifecycle.episodes import stored_episodes

        shown = stored_episodes(rec.run_dir, n=episodes) if rec.run_dir else []
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(render_html(result, history, shown), encoding="utf-8")
        written.append(str(report))
    if png_dir is not None:
        written += [str(p) for p in render_pngs(result, history, png_dir)]
    if json_out:
        _output.print_json({**result.to_json(), "written": written})
        return
    if not result.findings:
        _output.console.print(f"run {rec.id}: {result.steps} steps, no trigger fired (healthy)")
    rows = [(i, f.severity, f.branch, f.headline, f.runbook) for i, f in enumerate(result.findings, 1)]
    if rows:
        _output.console.print(_output.table(f"diagnosis of run {rec.id} ({result.steps} steps)",
                                            ["#", "severity", "branch", "evidence", "runbook"], rows))
        top = result.findings[0]
        if top.runbook:
            _output.console.print(f"next: rlctl runbook show {top.runbook}")
    for path in written:
        _output.console.print(f"wrote {path}")


@runbook_app.command("list")
def list_runbooks(json_out: bool = JsonOpt) -> None:
    """List runbooks in diagnosis-tree order."""
    from rlctl.incidents.runbooks import load_runbooks

    books = load_runbooks()
    if json_out:
        _output.print_json({"runbooks": [{"name": b.name, "title": b.title, "branch": b.branch, "order": b.order,
                                          "triggers": len(b.triggers), "path": b.path} for b in books]})
        return
    _output.console.print(_output.table(None, ["name", "branch", "title", "triggers"],
                                        [(b.name, b.branch, b.title, len(b.triggers)) for b in books]))


@runbook_app.command("show")
def show_runbook(name: str = typer.Argument(..., help="Runbook name (see `rlctl runbook list`)."),
                 json_out: bool = JsonOpt) -> None:
    """Print a runbook: triggers, checks, actions and its text."""
    from rlctl.incidents.runbooks import find_runbook, load_runbooks

    book = find_runbook(name, load_runbooks())
    if json_out:
        _output.print_json(book.model_dump(mode="json"))
        return
    _output.console.print(f"[bold]{book.title}[/] ({book.name}, branch {book.branch})")
    _output.console.print(_output.table("triggers", ["id", "severity", "condition", "meaning"],
                                        [(t.id, t.severity, t.describe(), t.summary) for t in book.triggers]))
    _output.console.print("checks:\n" + "\n".join(f"  {c}" for c in book.checks))
    _output.console.print("actions:\n" + "\n".join(f"  {i}. {a}" for i, a in enumerate(book.actions, 1)))
    _output.console.print(book.body, markup=False, highlight=False)


@runbook_app.command("check")
def check_runbook(name: str = typer.Argument(..., help="Runbook name."),
                  run: str = typer.Option(..., "--run", help="Run id (or a unique prefix)."),
                  no_checks: bool = typer.Option(False, "--no-checks", help="Only evaluate the triggers."),
                  registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Evaluate a runbook's triggers over a run's metrics and events and run its checks.

    Exit 0 = clear, 3 = a trigger fired or a check failed (1 stays "could not check").
    """
    from rlctl.incidents.runbooks import check_runbook as check, find_runbook, load_runbooks
    from rlctl.incidents.triggers import history_from

    book = find_runbook(name, load_runbooks())
    with open_registry(registry) as reg:
        rec = reg.get_run(run)
        history = history_from(reg.metrics(rec.id), reg.events(rec.id))
    env = {"RLCTL_REGISTRY_URL": registry} if registry else None
    result = check(book, rec.id, history, run_checks=not no_checks, env=env)
    if json_out:
        _output.print_json(result.to_json())
    else:
        state = "[red]TRIGGERED[/]" if result.triggered else "[green]clear[/]"
        _output.console.print(f"runbook {book.name} on run {rec.id}: {state}")
        for f in result.firings:
            _output.console.print(f"  [{f.trigger.severity}] {f.trigger.id}: {f.detail}", markup=False)
        for c in result.checks:
            _output.console.print(f"  check `{c.command}`: exit {c.exit_code} ({c.seconds:.1f}s)", markup=False)
    if result.triggered or not result.checks_passed:
        raise typer.Exit(3)
