"""Evaluate a model directory without a run: pass@k of a checkpoint or an exported Hugging Face model.

What this is: ``evaluate_model()``, behind ``rlctl eval CHECKPOINT_DIR|HF_DIR``.
It resolves the directory (a checkpoint's ``model/`` with the config stored in
its ``state.json``, or an HF directory with the config given on the command
line, else the defaults), hashes its weights, samples n answers per prompt of
the split at the config's temperature, grades them with the config's
correctness reward, and stores pass@k per k with a bootstrap CI as its own
record in the registry (``model_evals``, keyed by the weight hash).

What this is not: the run-vs-start comparison (rlctl.lifecycle.evaluate) or the
estimator (rlctl.lifecycle.passk).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from rlctl.config.models import RunConfig
from rlctl.contracts.errors import CheckpointError, DataError
from rlctl.contracts.types import ModelEvalRecord
from rlctl.hooks.manager import Plugins
from rlctl.registry.store import Registry

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@dataclass(frozen=True)
class ModelDir:
    path: Path  # the directory the user named
    policy_dir: Path  # the Hugging Face directory inside it
    kind: str  # "checkpoint" or "hf"
    config: dict[str, Any] | None  # a checkpoint's resolved config


def is_model_dir(text: str) -> bool:
    """Whether ``text`` names a directory (a checkpoint or a model), not a run id."""
    return Path(text).expanduser().is_dir()


def resolve_model_dir(text: str) -> ModelDir:
    """The policy directory and stored config of a checkpoint or HF model directory; errors name the fix."""
    path = Path(text).expanduser().resolve()
    if (path / "state.json").is_file():
        if not (path / "model" / "config.json").is_file() or not _weight_files(path / "model"):
            raise CheckpointError(f"checkpoint {path} has no consolidated model/ (a sharded learner's checkpoint)",
                                  f"export it first: rlctl export {path} --hf DIR, then rlctl eval DIR")
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        return ModelDir(path=path, policy_dir=path / "model", kind="checkpoint", config=state.get("config"))
    if (path / "config.json").is_file() and _weight_files(path):
        return ModelDir(path=path, policy_dir=path, kind="hf", config=None)
    raise DataError(f"{path} is neither a checkpoint (state.json and model/) nor a Hugging Face model directory "
                    "(config.json and weight files)", "name RUN_DIR/checkpoints/step-N, or a directory written by "
                    "`rlctl export CKPT --hf DIR`")


def model_hash(policy_dir: Path) -> str:
    """sha256 over the directory's weight files (relative name and bytes, in name order)."""
    digest = hashlib.sha256()
    for path in _weight_files(policy_dir):
        digest.update(path.relative_to(policy_dir).as_posix().encode() + b"\0")
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _weight_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def evaluate_model(registry: Registry, plugins: Plugins, model: ModelDir, config: RunConfig, ks: Sequence[int],
                   samples: int | None = None, split: str | None = None, num_prompts: int | None = None,
                   progress: Callable[[str], None] | None = None) -> ModelEvalRecord:
    """pass@k of ``model`` on ``config``'s task; stored in the registry and returned."""
    from rlctl.lifecycle.grading import sample_policy
    from rlctl.lifecycle.passk import samples_for, summarize
    from rlctl.placement.build import load_task

    n = samples_for(ks, samples, config.rollout.temperature)
    temperature = config.rollout.temperature if n > 1 else 0.0
    task = load_task(config, plugins)
    run_split = split or config.eval.split
    records = task.train + task.dev + task.hidden if run_split == "all" else task.split(run_split)
    limit = num_prompts if num_prompts is not None else config.eval.num_prompts
    records = records[:limit] if limit else records
    if not records:
        raise DataError(f"the {run_split} split of task {config.task.source} is empty", "pick another --split")
    digest = model_hash(model.policy_dir)
    if progress:
        progress(f"sampling {n} answer(s) per prompt for {len(records)} {run_split} prompts from {model.path}")
    started = time.perf_counter()
    scores = sample_policy(model.policy_dir, config, plugins, task, records, n, temperature)
    summary = summarize(scores.counts, n, ks, [r.id for r in records], config.eval.bootstrap_samples,
                        config.run.seed)
    details = {"kind": model.kind, "task": config.task.source, "dataset_version": task.version,
               "max_tokens": config.eval.max_tokens, "wall_s": time.perf_counter() - started,
               "grade_s": scores.grade_seconds, "prompts": summary["prompts"],
               "reward": config.reward.model_dump(mode="json")}
    if scores.grader is not None:  # eval.grader counted the correct samples
        details["eval_grader"] = scores.grader
    record = ModelEvalRecord(id=None, model_hash=digest, model_dir=str(model.path), split=run_split,
                             num_prompts=len(records), num_samples=n, temperature=temperature,
                             results=summary["pass_at_k"], created_at=time.time(), details=details)
    from rlctl.registry.model_evals import ModelEvalStore

    return ModelEvalStore(registry).add(record)


def model_config(model: ModelDir, config_path: Path | None, overrides: Sequence[str]) -> RunConfig:
    """The config to evaluate with: ``config_path`` if given, else a checkpoint's own, else the defaults;
    ``overrides`` on top."""
    from rlctl.config.load import apply_override, load_config, validate

    if config_path is not None or model.config is None:
        return load_config(config_path, overrides)
    raw = json.loads(json.dumps(model.config))
    for item in overrides:
        apply_override(raw, item)
    return validate(raw, source=f"{model.path}/state.json")
