"""``rlctl eval RUN``: hidden-split pass@1 of a run vs its starting policy."""

from __future__ import annotations

from typing import Any, List, Mapping, Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt, RegistryOpt, open_registry
from rlctl.contracts.types import EvalRecord


def eval_cmd(runs: Optional[List[str]] = typer.Argument(None, help="Run id(s) (or unique prefixes); several runs "
                                                        "(RL seeds) get a per-run and a pooled CI."),
             group: Optional[str] = typer.Option(None, "--group", help="Every run of this seed group "
                                                 "(printed by `rlctl train --seeds N`)."),
             split: Optional[str] = typer.Option(None, "--split", help="dev or hidden (default: the run's eval.split)."),
             num_prompts: Optional[int] = typer.Option(None, "--num-prompts", min=1, help="Evaluate the first N prompts."),
             registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Greedy pass@1 with fixed decoding, paired bootstrap 95% CI of final - start (pooled over several runs)."""
    from rlctl.contracts.errors import ConfigError
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.evaluate import evaluate_run

    if split not in (None, "dev", "hidden"):
        raise ConfigError(f"--split must be dev or hidden, got {split!r}", "use --split hidden")
    if not runs and group is None:
        raise typer.BadParameter("name a RUN (or several), or pass --group G", param_hint="RUNS")
    if group is not None or len(runs or []) > 1:
        from rlctl.cli.seeds import eval_group

        eval_group(runs or [], group, split, num_prompts, registry, json_out)
        return
    with open_registry(registry) as reg:
        record, details = evaluate_run(reg, load_plugins(), runs[0], split=split, num_prompts=num_prompts)
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
