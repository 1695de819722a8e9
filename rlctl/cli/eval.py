"""``rlctl eval RUN|CHECKPOINT_DIR|HF_DIR``: pass@1 of a run vs its start, pass@k of a run or a model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Mapping, Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt, RegistryOpt, open_registry
from rlctl.contracts.types import EvalRecord


def eval_cmd(runs: Optional[List[str]] = typer.Argument(None, help="Run id(s) (or unique prefixes); several runs "
                                                        "(RL seeds) get a per-run and a pooled CI. Or one checkpoint "
                                                        "directory or exported Hugging Face model directory, "
                                                        "evaluated without a run, then dotted overrides (k=v)."),
             group: Optional[str] = typer.Option(None, "--group", help="Every run of this seed group "
                                                 "(printed by `rlctl train --seeds N`)."),
             split: Optional[str] = typer.Option(None, "--split", help="dev or hidden (default: the run's "
                                            "eval.split); all: every prompt of the task, for a model directory."),
             num_prompts: Optional[int] = typer.Option(None, "--num-prompts", min=1, help="Evaluate the first N prompts."),
             k: Optional[str] = typer.Option(None, "--k", help="pass@k for these k, e.g. 1,10: n sampled answers per "
                                             "prompt at rollout.temperature, unbiased estimator, bootstrap 95% CI."),
             samples: Optional[int] = typer.Option(None, "--samples", min=1, help="Samples per prompt for --k "
                                                   "(default: the largest k; must be >= every k)."),
             config: Optional[Path] = typer.Option(None, "--config", help="For a model directory: the config whose "
                                                   "task, reward and decoding to use (default: a checkpoint's own "
                                                   "config, else the defaults)."),
             registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Greedy pass@1 with fixed decoding, paired bootstrap 95% CI of final - start (pooled over several runs);
    --k adds sampled pass@k. A checkpoint or model directory gets pass@k, stored as its own eval record."""
    from rlctl.contracts.errors import ConfigError
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.evaluate import evaluate_run
    from rlctl.lifecycle.evaluate_model import is_model_dir
    from rlctl.lifecycle.passk import parse_ks

    if split not in (None, "dev", "hidden", "all"):
        raise ConfigError(f"--split must be dev, hidden or all, got {split!r}", "use --split hidden")
    names = [r for r in runs or [] if "=" not in r]
    overrides = [r for r in runs or [] if "=" in r]
    ks = parse_ks(k) if k is not None else None
    if not names and group is None:
        raise typer.BadParameter("name a RUN (or several), a model directory, or pass --group G", param_hint="RUNS")
    if names and is_model_dir(names[0]):
        if len(names) > 1 or group is not None:
            raise ConfigError("a model directory is evaluated on its own", f"rlctl eval {names[0]} --k 1,10")
        _eval_model_dir(names[0], config, overrides, ks or [1], samples, split, num_prompts, registry, json_out)
        return
    if split == "all":
        raise ConfigError("--split all (every prompt of the task) is for a model directory; a run keeps train "
                          "apart", "use --split hidden or --split dev")
    if overrides or config is not None:
        raise ConfigError("a run is evaluated with its own config: overrides and --config are for a model "
                          "directory", "drop them, or evaluate RUN_DIR/checkpoints/step-N with them")
    if group is not None or len(names) > 1:
        if ks:
            raise ConfigError("--k evaluates one run or one model directory", "name a single RUN with --k")
        from rlctl.cli.seeds import eval_group

        eval_group(names, group, split, num_prompts, registry, json_out)
        return
    with open_registry(registry) as reg:
        record, details = evaluate_run(reg, load_plugins(), names[0], split=split, num_prompts=num_prompts,
                                       ks=ks, samples=samples)
    if json_out:
        _output.print_json({"eval": record})
    else:
        render_eval(record, details)
        if "pass_at_k" in details:
            render_pass_at_k(details["pass_at_k"], record.split, record.num_prompts)


def _eval_model_dir(path: str, config: Optional[Path], overrides: List[str], ks: List[int], samples: Optional[int],
                    split: Optional[str], num_prompts: Optional[int], registry: Optional[str], json_out: bool) -> None:
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.evaluate_model import evaluate_model, model_config, resolve_model_dir

    model = resolve_model_dir(path)
    cfg = model_config(model, config, overrides)
    with open_registry(registry) as reg:
        record = evaluate_model(reg, load_plugins(), model, cfg, ks, samples, split, num_prompts)
    if json_out:
        _output.print_json({"model_eval": record})
        return
    rows = [(f"pass@{kk}", v["value"] * 100, f"[{v['ci_low'] * 100:.1f}, {v['ci_high'] * 100:.1f}]")
            for kk, v in record.results.items()]
    title = (f"{record.split} pass@k, {record.num_prompts} prompts x {record.num_samples} samples at temperature "
             f"{record.temperature:g}, {record.details['kind']} {record.model_dir}"
             + _graded_by(record.details.get("eval_grader")))
    _output.console.print(_output.table(title, ["metric", "value (%)", "bootstrap 95% CI"], rows))
    _output.console.print(f"model sha256 {record.model_hash[:16]}; eval record {record.id}; "
                          f"{record.details['wall_s']:.1f} s (grading {record.details['grade_s']:.1f} s, "
                          f"{record.details['grade_s'] / (record.num_prompts * record.num_samples):.3f} s per sample)")


def _graded_by(grader: Mapping[str, Any] | None) -> str:
    """', graded by eval.grader NAME@VERSION' (and its failures) when the eval grader counted, else ''."""
    if not grader:
        return ""
    errors = f", {grader['errors']} grader errors counted as wrong" if grader.get("errors") else ""
    return f", graded by eval.grader {grader['version']}{errors}"


def render_pass_at_k(table: Mapping[str, Any], split: str, num_prompts: int) -> None:
    rows = []
    for name in ("start", "final"):
        for kk, v in table[name]["pass_at_k"].items():
            rows.append((name, f"pass@{kk}", v["value"] * 100, f"[{v['ci_low'] * 100:.1f}, {v['ci_high'] * 100:.1f}]"))
    title = (f"{split} pass@k, {num_prompts} prompts x {table['n']} samples at temperature {table['temperature']:g}"
             + _graded_by(table.get("grader")))
    _output.console.print(_output.table(title, ["policy", "metric", "value (%)", "bootstrap 95% CI"], rows))


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
    rate = details.get("tool_call_rate")
    if rate:  # episodes: the share of prompts on which the greedy policy called a tool
        _output.console.print(f"tool-call rate: start {rate['start']:.1%} -> final {rate['final']:.1%}")
    apart = details.get("eval_grader")
    if apart:  # eval.grader: the training reward vs the kept-apart eval score on the same answers
        name = f"{apart['final']['eval_grader']} ({apart['final']['eval_grader_version']})"
        _output.console.print(_output.table(
            f"training reward vs eval score (eval.grader {name}), same {record.split} answers",
            ["policy", "training reward", "eval score", "gap"],
            [(who, a["train_reward"], a["eval_score"], f"{a['gap']:+.3f}")
             for who, a in (("start", apart["start"]), ("final", apart["final"]))]))
