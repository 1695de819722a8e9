"""``rlctl episodes RUN``: a run's stored episodes, turn by turn (thin renderer over rlctl.lifecycle.episodes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt, RegistryOpt, open_registry

POLICY_STYLE = "bold green"  # what the policy wrote (trained on)
ENV_STYLE = "black on yellow"  # what the environment wrote (a tool's answer; never trained on)
BAD_TOOL_STYLE = "bold white on red"


def episodes(run: str = typer.Argument(..., help="Run id (or a unique prefix)."),
             step: Optional[int] = typer.Option(None, "--step", help="Only this step (negative: from the end, "
                                                "-1 = the last stored step); default every stored step."),
             n: int = typer.Option(4, "--n", min=1, help="Episodes to show (the newest)."),
             registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Show a run's stored training episodes turn by turn: the policy's and the environment's tokens told apart,
    each tool call's name, status and latency, per-turn and final rewards (the run keeps a few per logged step in
    <run_dir>/samples.jsonl, a dropped group's among them)."""
    from rlctl.contracts.errors import RegistryError
    from rlctl.engine.samples import FILE
    from rlctl.lifecycle.episodes import stored_episodes

    with open_registry(registry) as reg:
        rec = reg.get_run(run)
    if not rec.run_dir:
        raise RegistryError(f"run {rec.id} has no run directory, so no stored episodes",
                            "episodes are kept in the run directory of a run trained by this version of rlctl")
    shown = stored_episodes(rec.run_dir, step=step, n=n)
    if json_out:
        _output.print_json({"run_id": rec.id, "episodes": shown})
        return
    if not shown:
        where = f" at step {step}" if step is not None else ""
        _output.console.print(f"run {rec.id}: no stored episodes{where} in {Path(rec.run_dir) / FILE} "
                              "(the run keeps a few per logged step)")
        return
    _output.console.print(f"[{POLICY_STYLE}]policy tokens[/] / [{ENV_STYLE}]environment tokens[/]")
    for episode in shown:
        render(episode)


def render(episode: dict[str, Any]) -> None:
    """One episode: a header line, the prompt, then each turn as a labelled, styled block."""
    from rich.panel import Panel
    from rich.text import Text

    reward = "unscored" if episode["reward"] is None else f"{episode['reward']:.3g}"
    parts = ", ".join(f"{k} {v:.3g}" for k, v in sorted(episode["reward_components"].items()))
    head = (f"{episode['id']} · step {episode['step']} · {episode['status']} · reward {reward}"
            + (f" ({parts})" if parts else "") + (f" · error {episode['reward_error']}" if episode["reward_error"]
                                                  else "")
            + f" · {episode['terminal_reason']} · versions {episode['policy_versions']}"
            + f" · {episode['policy_tokens']} policy / {episode['env_tokens']} env tokens")
    body = Text()
    body.append("prompt: ", style="dim")
    body.append(episode["prompt"] + "\n", style="dim")
    for i, turn in enumerate(episode["turns"]):
        body.append(f"[{i}] {label(turn)}\n", style="italic")
        style = POLICY_STYLE if turn["writer"] == "policy" else (
            ENV_STYLE if turn["tool_status"] in (None, "ok") else BAD_TOOL_STYLE)
        body.append(turn["text"] or " ".join(map(str, turn["tokens"])), style=style)
        body.append("\n")
    _output.console.print(Panel(body, title=Text(head), title_align="left", expand=True))


def label(turn: dict[str, Any]) -> str:
    """``policy v3, 12 tokens`` or ``env calculator ok 0.012s, 4 tokens``, with the turn's reward if any."""
    size = f"{turn['end'] - turn['start']} tokens"
    if turn["writer"] == "policy":
        text = f"policy v{turn['policy_version']}, {size}"
    else:
        from rlctl.incidents.diagnose import tool_label

        tool = tool_label(turn)
        text = f"env{tool}, {size}"
    return text + (f", turn reward {turn['reward']:.3g}" if turn["reward"] is not None else "")
