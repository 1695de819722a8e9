"""Diagnose a run from its recorded metrics and events: ranked findings, each with evidence and a runbook.

What this is: ``diagnose(history, runbooks)`` walks the diagnosis tree, which
is the runbooks' triggers in tree order (numerics first, then grader, lag,
collapse / hacking / instability, and data last): every trigger that fires
becomes evidence of a finding (one finding per runbook and branch). Findings
are ranked by cause (rlctl.incidents.causes): a finding another one explains
(a reward collapse whose onset follows a length-hacking episode) is a
consequence, ranked right after its cause and saying "follows ..."; the root
findings are ranked by severity, then onset (the first flagged step), then the
branch's position in the tree, then how far past its bound the worst trigger
went. Wall-clock findings (throughput falling, step time growing) are checked
against the machine's recorded load: when the machine was busy they become an
``info`` finding that names the load instead of blaming the engine. ``diagnose_run`` reads the
run from the registry. ``render_html`` / ``render_pngs`` draw the metric
curves of each finding with the flagged windows shaded (matplotlib, PNGs
embedded base64 in one self-contained HTML file); the HTML report ends with
a few of the run's stored episodes (rlctl.lifecycle.episodes), turn by turn,
policy and environment tokens in different colours.

What this is not: the trigger semantics (rlctl.incidents.triggers), the runbook
files (rlctl.incidents.runbooks) or the CLI (rlctl.cli.diagnose).
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlctl.contracts.episodes import FAILED_TOOL_STATUSES
from rlctl.incidents.causes import account_for_load, rank_by_cause
from rlctl.incidents.runbooks import Runbook, load_runbooks
from rlctl.incidents.triggers import SEVERITY_RANK, Firing, History, evaluate, history_from

RECOVERY_EVENTS = ("nan_rollback", "oom_recovered", "groups_dropped", "verifier_retry", "checkpoint_fallback",
                   "supervisor_restart", "alert", "fault_injected", "hang", "resumed")


@dataclass(frozen=True, slots=True)
class Finding:
    """One diagnosed problem: its branch, severity, the triggers that fired (evidence) and the runbook to open."""

    branch: str
    runbook: str
    title: str
    severity: str
    firings: tuple[Firing, ...]
    actions: tuple[str, ...]
    order: int
    follows: str = ""  # "follows <cause> (from step N)" when another finding explains this one

    @property
    def onset(self) -> int:
        """The first flagged step of any of its triggers."""
        return min((w[0] for f in self.firings for w in f.windows), default=-1)

    @property
    def score(self) -> tuple[int, int, int, float]:
        return (SEVERITY_RANK[self.severity], -self.onset, -self.order, max(f.magnitude for f in self.firings))

    @property
    def headline(self) -> str:
        lead = max(self.firings, key=lambda f: (SEVERITY_RANK[f.trigger.severity], f.magnitude))
        return f"{lead.trigger.summary}: {lead.detail}" + (f"; {self.follows}" if self.follows else "")

    def to_json(self) -> dict[str, Any]:
        return {"branch": self.branch, "runbook": self.runbook, "title": self.title, "severity": self.severity,
                "onset": self.onset, "follows": self.follows or None, "headline": self.headline, "evidence": [f.to_json() for f in self.firings],
                "actions": list(self.actions), "open": f"rlctl runbook show {self.runbook}"}


@dataclass(frozen=True, slots=True)
class Diagnosis:
    run_id: str
    findings: tuple[Finding, ...]
    steps: int
    events: tuple[dict[str, Any], ...]  # recovery / fault events, for the report

    @property
    def top(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "steps_recorded": self.steps, "healthy": not any(
            SEVERITY_RANK[f.severity] >= SEVERITY_RANK["high"] for f in self.findings),
            "findings": [f.to_json() for f in self.findings], "events": list(self.events)}


def diagnose(run_id: str, history: History, runbooks: Sequence[Runbook]) -> Diagnosis:
    """Evaluate every runbook trigger over ``history`` and rank the findings (see the module docstring)."""
    grouped: dict[tuple[str, str], list[Firing]] = {}
    books = {b.name: b for b in runbooks}
    for book in runbooks:
        for trigger in book.triggers:
            firing = evaluate(trigger, history)
            if firing is not None:
                grouped.setdefault((book.name, book.branch_of(trigger)), []).append(firing)
    findings = []
    for (name, branch), firings in grouped.items():
        book = books[name]
        severity = max((f.trigger.severity for f in firings), key=SEVERITY_RANK.__getitem__)
        order = book.order if branch == book.branch else _branch_order(branch, runbooks, book.order)
        findings.append(Finding(branch=branch, runbook=name, title=book.title, severity=severity,
                                firings=tuple(firings), actions=tuple(book.actions), order=order))
    steps = max((s for series in history.metrics.values() for s, _ in series), default=-1) + 1
    if not findings and _reward_flat(history):
        findings.append(_data_finding(history))
    findings = rank_by_cause([account_for_load(f, history) for f in findings])
    events = tuple({"kind": e.kind, "message": e.message, "step": (e.data or {}).get("step")}
                   for e in history.events if e.kind in RECOVERY_EVENTS)
    return Diagnosis(run_id=run_id, findings=tuple(findings), steps=steps, events=events)


def diagnose_run(registry: Any, run_ref: str, runbooks: Sequence[Runbook] | None = None) -> Diagnosis:
    """Diagnose a registry run (id or unique prefix) from its metrics table and event log."""
    run = registry.get_run(run_ref)
    history = history_from(registry.metrics(run.id), registry.events(run.id))
    return diagnose(run.id, history, runbooks if runbooks is not None else load_runbooks())


def _branch_order(branch: str, runbooks: Sequence[Runbook], default: int) -> int:
    return next((b.order for b in runbooks if b.branch == branch), default)


def _reward_flat(history: History) -> bool:
    rewards = [v for _, v in history.metrics.get("reward_mean", ()) if math.isfinite(v)]
    if len(rewards) < 6:
        return False
    third = len(rewards) // 3
    return sum(rewards[-third:]) / third <= sum(rewards[:third]) / third


def _data_finding(history: History) -> Finding:
    """Nothing fired but the reward did not improve: the last branch of the tree (data, template, tokenizer)."""
    from rlctl.incidents.triggers import Trigger

    trigger = Trigger(id="reward-flat", when="drops", metric="reward_mean", by=0.0, window=1, severity="info",
                      summary="reward did not improve and no other trigger fired")
    series = tuple(history.metrics.get("reward_mean", ()))
    firing = Firing(trigger, ((series[0][0], series[-1][0]),), series,
                    f"reward_mean {series[0][1]:.3g} at step {series[0][0]} -> {series[-1][1]:.3g} at {series[-1][0]}")
    actions = ("Check the dataset version, prompt template and tokenizer hash against a run that learned "
               "(`rlctl runs compare A B`).", "Look for duplicate or mislabelled samples in the train split.")
    return Finding(branch="data", runbook="", title="No learning signal", severity="info", firings=(firing,),
                   actions=actions, order=9)


# -- pictures ---------------------------------------------------------------


def plot_finding(finding: Finding, history: History) -> bytes:
    """PNG bytes: one panel per metric of the finding, flagged windows shaded, the bound drawn."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    panels: dict[str, list[Firing]] = {}
    for f in finding.firings:
        panels.setdefault(f.trigger.metric or _event_panel(history), []).append(f)
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 2.3 * len(panels)), squeeze=False, sharex=True)
    for ax, (metric, firings) in zip(axes[:, 0], panels.items()):
        series = [(s, v) for s, v in history.metrics.get(metric, ()) if math.isfinite(v)]
        if series:
            ax.plot([s for s, _ in series], [v for _, v in series], color="#1f5fa8", lw=1.6, marker=".", ms=4)
        for f in firings:
            for a, b in f.windows:
                ax.axvspan(a - 0.5, b + 0.5, color=_shade(f.trigger.severity), alpha=0.25, lw=0)
            if f.trigger.when in ("above", "below") and f.trigger.threshold is not None:
                ax.axhline(f.trigger.threshold, color="#a33", ls="--", lw=1)
            if f.trigger.when in ("nonfinite", "occurs"):
                for s, _ in f.values:
                    ax.axvline(s, color="#a33", lw=1.2)
        ax.set_ylabel(metric, fontsize=8)
        ax.set_title("; ".join(f.trigger.describe() for f in firings), fontsize=8, loc="left")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(f"[{finding.severity}] {finding.branch}: {finding.title}", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _event_panel(history: History) -> str:
    for name in ("reward_mean", "step_time_s", "loss"):
        if history.metrics.get(name):
            return name
    return next(iter(history.metrics), "reward_mean")


def _shade(severity: str) -> str:
    return {"critical": "#d62728", "high": "#ff7f0e", "warning": "#e6c200"}.get(severity, "#999999")


def render_pngs(diagnosis: Diagnosis, history: History, directory: Path) -> list[Path]:
    """One PNG per finding, ``<directory>/<rank>-<branch>.png``."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for i, finding in enumerate(diagnosis.findings, 1):
        path = directory / f"{i:02d}-{finding.branch}.png"
        path.write_bytes(plot_finding(finding, history))
        out.append(path)
    return out


def render_html(diagnosis: Diagnosis, history: History, episodes: Sequence[dict[str, Any]] = ()) -> str:
    """A self-contained HTML report (plots embedded as base64 PNG); ``episodes``: rlctl.lifecycle.episodes.episode_json
    dicts shown at the end."""
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>rlctl diagnose {e(diagnosis.run_id)}</title>",
             "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}h2{margin-top:2em}"
             ".critical{color:#b00}.high{color:#c60}.warning{color:#a80}.info{color:#666}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;font-size:90%}"
             ".turn{white-space:pre-wrap;font-family:monospace;padding:2px 4px;margin:2px 0}"
             ".policy{background:#e3f4e3}.env{background:#fff3c4}.failed{background:#f8c9c9}"
             ".who{font-size:80%;color:#555}</style>",
             f"</head><body><h1>rlctl diagnose {e(diagnosis.run_id)}</h1>",
             f"<p>{diagnosis.steps} recorded steps; {len(diagnosis.findings)} finding(s), most severe first.</p>"]
    if not diagnosis.findings:
        parts.append("<p><b>No trigger fired.</b> Every runbook condition holds.</p>")
    for i, f in enumerate(diagnosis.findings, 1):
        png = base64.b64encode(plot_finding(f, history)).decode()
        parts.append(f"<h2 class='{f.severity}'>{i}. [{e(f.severity)}] {e(f.branch)}: {e(f.title)}</h2>"
                     f"<p>{e(f.headline)}</p>")
        if f.runbook:
            parts.append(f"<p>Runbook: <code>rlctl runbook show {e(f.runbook)}</code></p>")
        parts.append("<table><tr><th>trigger</th><th>condition</th><th>evidence</th></tr>" + "".join(
            f"<tr><td>{e(x.trigger.id)}</td><td>{e(x.trigger.describe())}</td><td>{e(x.detail)}</td></tr>"
            for x in f.firings) + "</table>")
        parts.append(f"<p><img alt='{e(f.branch)} metrics' src='data:image/png;base64,{png}'></p>")
        parts.append("<ol>" + "".join(f"<li>{e(a)}</li>" for a in f.actions) + "</ol>")
    if diagnosis.events:
        parts.append("<h2>Faults and recoveries</h2><table><tr><th>step</th><th>event</th><th>message</th></tr>")
        parts += [f"<tr><td>{e(str(ev['step']))}</td><td>{e(ev['kind'])}</td><td>{e(ev['message'])}</td></tr>"
                  for ev in diagnosis.events]
        parts.append("</table>")
    if episodes:
        parts.append("<h2>Episodes</h2><p>A few stored episodes (<code>rlctl episodes RUN</code>): "
                     "<span class='turn policy'>policy tokens</span> <span class='turn env'>environment tokens"
                     "</span> <span class='turn failed'>a failed tool call</span></p>")
        parts += [episode_html(ep) for ep in episodes]
    parts.append("</body></html>")
    return "\n".join(parts)


def episode_html(episode: dict[str, Any]) -> str:
    """One episode as HTML: a header line and one block per turn, coloured by who wrote it."""
    e = html.escape
    reward = "unscored" if episode["reward"] is None else f"{episode['reward']:.3g}"
    out = [f"<h3>{e(episode['id'])} &middot; step {episode['step']} &middot; {e(episode['status'])} &middot; "
           f"reward {reward}" + (f" &middot; error {e(episode['reward_error'])}" if episode["reward_error"] else "")
           + f" &middot; {e(episode['terminal_reason'])}</h3>",
           f"<div class='who'>prompt</div><div class='turn'>{e(episode['prompt'])}</div>"]
    for turn in episode["turns"]:
        if turn["writer"] == "policy":
            who, css = f"policy v{turn['policy_version']}", "policy"
        else:
            tool = tool_label(turn)
            who, css = f"env{tool}", "env" if turn["tool_status"] in (None, "ok") else "failed"
        if turn["reward"] is not None:
            who += f", turn reward {turn['reward']:.3g}"
        out.append(f"<div class='who'>{e(who)}, {turn['end'] - turn['start']} tokens</div>"
                   f"<div class='turn {css}'>{e(turn['text'])}</div>")
    return "\n".join(out)


def tool_label(turn: Mapping[str, Any]) -> str:
    """`` calculator ok 0.012s`` (`` ... after 2 retries`` when failed attempts were run again) for an
    environment turn of rlctl.lifecycle.episodes.episode_json; a failed step that named no tool (a crashed
    or hung environment) is ``environment``'s; "" when the turn ran no tool."""
    if not turn["tool"] and turn["tool_status"] not in FAILED_TOOL_STATUSES:
        return ""
    retries = turn.get("tool_retries", 0)
    return (f" {turn['tool'] or 'environment'} {turn['tool_status']} {turn['tool_seconds']:.3f}s"
            + (f" after {retries} retries" if retries else ""))
