"""``rlctl eval RUN``: hidden-split pass@1 of a run vs its starting policy."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt, RegistryOpt, open_registry
from rlctl.contracts.types import EvalRecord


def eval_cmd(run: str = typer.Argument(..., help="Run id (or a unique prefix)."),
             split: Optional[str] = typer.Option(None, "--split", help="dev or hidden (default: the run's eval.split)."),
             num_prompts: Optional[int] = typer.Option(None, "--num-prompts", min=1, help="Evaluate the first N prompts."),
             registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Greedy pass@1 with fixed decoding, paired bootstrap 95% CI of final - start."""
    from rlctl.contracts.errors import ConfigError
    from rlctl.hooks.manager import load_plugins
    from rlctl.ops.evaluate import evaluate_run

    if split not in (None, "dev", "hidden"):
        raise ConfigError(f"--split must be dev or hidden, got {split!r}", "use --split hidden")
    with open_registry(registry) as reg:
        record, details = evaluate_run(reg, load_plugins(), run, split=split, num_prompts=num_prompts)
    if json_out:
        _output.print_json({"eval": record})
    else:
        render_eval(record, details)


def render_eval(record: EvalRecord, details: Mapping[str, Any]) -> None:
    rows = [
        (f"{record.baseline_name} (warm-start policy)", record.baseline_pass_at_1 * 100, ""),
        (f"{record.candidate_name} (after RL)", record.candidate_pass_at_1 * 100, ""),
        ("difference (points)", record.diff * 100,
         f"[{record.ci_low * 100:+.1f}, {record.ci_high * 100:+.1f}]"),
    ]
    title = f"{record.split} pass@1, greedy, {record.num_prompts} prompts, run {record.run_id}"
    _output.console.print(_output.table(title, ["policy", "pass@1 (%)", "paired bootstrap 95% CI"], rows))
    excludes = record.ci_low > 0 or record.ci_high < 0
    verdict = "excludes 0" if excludes else "includes 0: no significant difference"
    _output.console.print(f"CI {verdict}; wins {details.get('wins', '?')}, losses {details.get('losses', '?')}")
