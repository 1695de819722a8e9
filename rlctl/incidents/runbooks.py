"""Machine-checkable runbooks: markdown files with YAML front matter (triggers, checks, actions).

What this is: loading and validating the runbooks (``load_runbooks``), finding
them both in a source checkout (``<repo>/runbooks/``) and in an installed
distribution (shipped as data files under ``share/rlctl/runbooks/``), and
``check_runbook``, which evaluates a runbook's triggers against a run's
recorded metrics and events and runs its checks (``rlctl ...`` commands, in a
subprocess, exit status 0 = pass).

A runbook file::

    ---
    name: oom
    title: Out of memory
    branch: memory
    triggers:
      - {id: oom-recovered, when: occurs, event: oom_recovered, severity: high, summary: ...}
    checks:
      - rlctl runs show {run}
    actions:
      - Lower algo.micro_batch_size ...
    ---
    # Out of memory
    ...

What this is not: the trigger semantics (rlctl.incidents.triggers) or the diagnosis
ranking (rlctl.incidents.diagnose).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlctl.contracts.errors import RunbookError
from rlctl.incidents.triggers import Firing, History, Trigger, evaluate

_FRONT = re.compile(r"\A---\s*\n(.*?)\n---\s*\n(.*)\Z", re.S)
DATA_DIR = "share/rlctl/runbooks"


class Runbook(BaseModel):
    """One incident's runbook: what detects it (triggers), how to confirm (checks), what to do (actions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Equals the file name without .md.")
    title: str
    branch: str = Field(description="Diagnosis branch: numerics, grader, lag, hacking, instability, memory, "
                        "sync, hang, data.")
    order: int = Field(5, ge=1, description="Position of the branch in the diagnosis tree (1 = checked first).")
    triggers: list[Trigger] = Field(min_length=1)
    checks: list[str] = Field(default_factory=list, description="rlctl commands; {run} is the run id.")
    actions: list[str] = Field(min_length=1)
    body: str = ""
    path: str = ""

    @field_validator("checks")
    @classmethod
    def _rlctl_only(cls, checks: list[str]) -> list[str]:
        for check in checks:
            if not check.startswith("rlctl "):
                raise ValueError(f"check {check!r} is not an rlctl command; checks must start with 'rlctl '")
        return checks

    @model_validator(mode="after")
    def _unique_ids(self) -> "Runbook":
        ids = [t.id for t in self.triggers]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"trigger id(s) listed twice: {', '.join(dup)}")
        return self

    def branch_of(self, trigger: Trigger) -> str:
        return trigger.branch or self.branch


def runbook_dirs() -> list[Path]:
    """Where runbooks live: RLCTL_RUNBOOKS (a directory), the source checkout, the installed data files."""
    found = []
    if os.environ.get("RLCTL_RUNBOOKS"):
        found.append(Path(os.environ["RLCTL_RUNBOOKS"]).expanduser())
    checkout = Path(__file__).resolve().parents[2] / "runbooks"
    if checkout.is_dir():
        found.append(checkout)
    installed = _installed_dir()
    if installed is not None and installed not in found:
        found.append(installed)
    return found


def _installed_dir() -> Path | None:
    try:
        files = metadata.distribution("rlctl").files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if DATA_DIR in str(f).replace("\\", "/") and str(f).endswith(".md"):
            return Path(str(f.locate())).resolve().parent
    return None


def load_runbooks(directory: Path | None = None) -> list[Runbook]:
    """Every runbook of the first runbook directory found (or of ``directory``), sorted by tree order, name."""
    if directory is None:
        dirs = runbook_dirs()
        if not dirs:
            raise RunbookError("no runbooks directory found (neither a source checkout nor installed data files)",
                               "reinstall rlctl, or point RLCTL_RUNBOOKS at a directory of runbooks")
        directory = dirs[0]
    books = [parse_runbook(p) for p in sorted(Path(directory).glob("*.md")) if p.name.lower() != "readme.md"]
    if not books:
        raise RunbookError(f"{directory} holds no runbooks (*.md)", "point RLCTL_RUNBOOKS at the runbooks/ folder")
    return sorted(books, key=lambda b: (b.order, b.name))


def parse_runbook(path: Path) -> Runbook:
    """Parse and validate one runbook file; a bad one is a RunbookError naming the file and the field."""
    text = path.read_text(encoding="utf-8")
    match = _FRONT.match(text)
    if not match:
        raise RunbookError(f"runbook {path} has no YAML front matter", "start the file with '---', the YAML "
                           "(name, title, branch, triggers, checks, actions), then '---'")
    try:
        raw = yaml.safe_load(match.group(1)) or {}
    except yaml.YAMLError as err:
        raise RunbookError(f"runbook {path}: front matter is not valid YAML ({err})", "fix the YAML") from None
    if not isinstance(raw, dict):
        raise RunbookError(f"runbook {path}: front matter must be a mapping", "use key: value lines")
    try:
        book = Runbook(**raw, body=match.group(2), path=str(path))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise RunbookError(f"runbook {path}: {where}: {first['msg']}", "see runbooks/README.md for the format") from None
    if book.name != path.stem:
        raise RunbookError(f"runbook {path}: name {book.name!r} differs from the file name",
                           f"rename the file to {book.name}.md or set name: {path.stem}")
    return book


def find_runbook(name: str, books: Sequence[Runbook]) -> Runbook:
    import difflib

    for book in books:
        if book.name == name:
            return book
    names = [b.name for b in books]
    close = difflib.get_close_matches(name, names, n=1)
    raise RunbookError(f"no runbook named {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""),
                       f"runbooks: {', '.join(names)}")


@dataclass(frozen=True, slots=True)
class CheckResult:
    command: str
    exit_code: int
    output_tail: str
    seconds: float


@dataclass(frozen=True, slots=True)
class RunbookReport:
    runbook: Runbook
    run_id: str
    firings: tuple[Firing, ...]
    checks: tuple[CheckResult, ...]

    @property
    def triggered(self) -> bool:
        return bool(self.firings)

    @property
    def checks_passed(self) -> bool:
        return all(c.exit_code == 0 for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {"runbook": self.runbook.name, "run_id": self.run_id, "triggered": self.triggered,
                "firings": [f.to_json() for f in self.firings],
                "checks": [{"command": c.command, "exit_code": c.exit_code, "seconds": round(c.seconds, 2),
                            "output_tail": c.output_tail} for c in self.checks],
                "checks_passed": self.checks_passed, "actions": list(self.runbook.actions)}


def fire(book: Runbook, history: History) -> list[Firing]:
    """The runbook's triggers that fired over ``history``."""
    return [f for t in book.triggers if (f := evaluate(t, history)) is not None]


def check_runbook(book: Runbook, run_id: str, history: History, *, run_checks: bool = True,
                  env: dict[str, str] | None = None, timeout_s: float = 120.0) -> RunbookReport:
    """Evaluate ``book``'s triggers over ``history`` and (optionally) run its checks against ``run_id``."""
    import time

    results = []
    if run_checks:
        for check in book.checks:
            argv = shlex.split(check.format(run=run_id))[1:]
            started = time.perf_counter()
            try:
                done = subprocess.run([sys.executable, "-m", "rlctl.cli.app", *argv], capture_output=True, text=True,
                                      timeout=timeout_s, env={**os.environ, **(env or {})})
                code, out = done.returncode, (done.stdout + done.stderr)[-800:]
            except subprocess.TimeoutExpired:
                code, out = 124, f"timed out after {timeout_s:.0f}s"
            results.append(CheckResult(check.format(run=run_id), code, out, time.perf_counter() - started))
    return RunbookReport(book, run_id, tuple(fire(book, history)), tuple(results))
