"""Capture a run's whole state between two steps, and restore its roles from it.

What this is: ``StepCheckpointer`` (what the loop calls after every step: it
decides whether a checkpoint is due, snapshots the roles and hands the copy
to a CheckpointStore, which writes it in the background), ``capture`` and
``restore`` (learner, data cursor, shadow batch, rollout backend, process RNG
states), and ``compatibility_problems``, the check a resume runs before it
trusts a checkpoint with today's config, data and tokenizer.

Restore order (a resumed run must continue exactly where it stopped, and
loading never runs code): the learner first, then the
data cursor, then the shadow forward (refuse if the log-probs moved beyond the
tolerance), then the rollout backend receives the restored weights before it
generates anything, and the process RNG states come last so nothing above
consumes them.

What this is not: the file format and commit protocol (rlctl.engine.checkpoint)
or run bookkeeping such as registry rows and resume events (rlctl.lifecycle).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from rlctl.config.load import config_changes
from rlctl.config.models import RESUME_MUTABLE_PATHS
from rlctl.contracts.batch import TrainBatch
from rlctl.contracts.errors import CheckpointError
from rlctl.contracts.roles import (
    CheckpointableLearner, CheckpointStore, RestartableLearner, ShardedCheckpointLearner, StatefulRollout,
)
from rlctl.contracts.checkpoints import CheckpointState, ShadowBatch
from rlctl.engine import state_codec
from rlctl.engine.batching import CursorState
from rlctl.engine.roles import ResumePoint, Roles

SHADOW_PROMPTS = 4  # rows of the shadow batch: the first train prompts with their reference answers


@dataclass(frozen=True, slots=True, kw_only=True)
class Provenance:
    """Who a checkpoint belongs to: the run and the code and config it was produced with."""

    run_id: str
    config_hash: str
    code_version: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreReport:
    """What ``restore`` found: where the loop continues, the shadow forward's max |log-prob difference|, notes."""

    resume: ResumePoint
    shadow_max_abs_diff: float
    notes: tuple[str, ...] = field(default_factory=tuple)


class StepCheckpointer:
    """Checkpoints a run's roles after every ``every_steps`` completed steps and after the last step.

    ``after_step`` blocks only while the state is copied (and while a previous
    save is still in flight); the store writes the copy in the background.
    ``blocking_s`` records how long each save blocked the loop.
    """

    def __init__(self, roles: Roles, store: CheckpointStore, provenance: Provenance, *, every_steps: int,
                 total_steps: int) -> None:
        if every_steps and not isinstance(roles.learner, (CheckpointableLearner, ShardedCheckpointLearner)):
            raise CheckpointError(
                f"learner backend {roles.config.train.learner!r} cannot be checkpointed "
                "(it has no checkpoint_state / load_checkpoint_state, nor save_shards / load_shards)",
                "set checkpoint.every_steps=0 to train without checkpoints, or use a learner that supports them",
            )
        self.roles, self.store, self.provenance = roles, store, provenance
        self.every_steps, self.total_steps = every_steps, total_steps
        self.blocking_s: list[float] = []
        self._shadow: TrainBatch | None = None
        # (steps_done, metrics) -> (metrics to save, save even when not due): the run's dev eval adds its score
        # to the manifest and asks for a save at a new best dev score (rlctl.lifecycle.periodic_eval)
        self.prepare: Callable[[int, Mapping[str, float]], tuple[Mapping[str, float], bool]] | None = None

    def due(self, steps_done: int) -> bool:
        return self.every_steps > 0 and (steps_done % self.every_steps == 0 or steps_done == self.total_steps)

    def after_step(self, steps_done: int, metrics: Mapping[str, float],
                   queue_cursor: Mapping[str, Any] | None = None) -> None:
        """Called by the loop once the step's metrics are logged; saves when a checkpoint is due.

        ``queue_cursor``: the overlapped driver's trajectory-queue cursor, saved with the checkpoint.
        """
        force = False
        if self.prepare is not None:
            metrics, force = self.prepare(steps_done, metrics)
        if not (force and self.every_steps > 0) and not self.due(steps_done):
            return
        started = time.perf_counter()
        if self._shadow is None:
            self._shadow = shadow_batch(self.roles)
        self.store.save(capture(self.roles, steps_done, metrics, self.provenance, self._shadow, self.store,
                                queue_cursor))
        self.blocking_s.append(time.perf_counter() - started)

    def close(self, abort: bool = False) -> None:
        """Wait for the save in flight (or abandon it cleanly with ``abort``)."""
        self.store.close(abort=abort)


def capture(roles: Roles, steps_done: int, metrics: Mapping[str, float], provenance: Provenance,
            shadow: TrainBatch, store: CheckpointStore | None = None,
            queue_cursor: Mapping[str, Any] | None = None) -> CheckpointState:
    """A private copy of everything the next step depends on.

    A sharded learner writes its shards now, into the store's staging
    directory of this checkpoint (``store`` is required then); the store
    checksums them with the other files.
    """
    learner = roles.learner
    if isinstance(learner, ShardedCheckpointLearner):
        if store is None:
            raise CheckpointError(f"learner backend {roles.config.train.learner!r} writes sharded checkpoints "
                                  "and needs the checkpoint store's staging directory", "pass the store to capture")
        learner_state = learner.save_shards(store.stage_shards(steps_done))
    else:
        assert isinstance(learner, CheckpointableLearner)
        learner_state = learner.checkpoint_state()
    rollout = roles.rollout
    return CheckpointState(
        step=steps_done, learner=learner_state,
        rollout=state_codec.clone(rollout.state()) if isinstance(rollout, StatefulRollout) else None,
        cursor={"epoch": roles.cursor.state.epoch, "position": roles.cursor.state.position},
        rng=capture_rng(),
        shadow=ShadowBatch(input_ids=shadow.input_ids, attention_mask=shadow.attention_mask,
                           action_mask=shadow.action_mask, logprobs=learner.logprobs(shadow).float(),
                           sampling=shadow.sampling),
        run_id=provenance.run_id, config=roles.config.model_dump(mode="json"),
        config_hash=provenance.config_hash, code_version=provenance.code_version,
        dataset_version=roles.task.version, tokenizer_hash=roles.tokenizer_hash,
        tokenizer_dir=str(roles.policy_dir), metrics=dict(metrics),
        critic=state_codec.clone(roles.critic.state()) if roles.critic is not None else None,
        queue=dict(queue_cursor) if queue_cursor is not None else None,
    )


def restore(roles: Roles, state: CheckpointState, shadow_tolerance: float) -> RestoreReport:
    """Put ``roles`` exactly where it was when ``state`` was captured (see the module docstring)."""
    learner = roles.learner
    if state.learner.shard_dir is not None:
        if not isinstance(learner, ShardedCheckpointLearner):
            raise CheckpointError(f"the checkpoint of step {state.step} is sharded (its ranks wrote shards/) and "
                                  f"learner backend {roles.config.train.learner!r} cannot load shards",
                                  "resume with the sharded learner the run was trained with (any world size), or "
                                  "`rlctl export --hf` the checkpoint and start a new run from the export")
        learner.load_shards(state.learner)
    elif isinstance(learner, CheckpointableLearner):
        learner.load_checkpoint_state(state.learner)
    else:
        raise CheckpointError(f"learner backend {roles.config.train.learner!r} cannot load a checkpoint "
                              f"of step {state.step} (it holds full weights, not shards)",
                              "resume with the learner the run was trained with")
    if (state.critic is None) != (roles.critic is None):
        raise CheckpointError(
            "the checkpoint " + ("has no critic but this run needs one" if state.critic is None
                                 else "holds a critic but this run's estimator uses none"),
            "resume with the algo.name the run was trained with")
    if roles.critic is not None:
        roles.critic.load_state(state.critic)
    roles.cursor.state = _cursor(state.cursor, len(roles.cursor.records))
    drift = shadow_drift(learner, state.shadow)
    if not drift <= shadow_tolerance:
        raise CheckpointError(
            f"the shadow forward after restoring step {state.step} differs from the log-probs saved with it by "
            f"{drift:.3g} > checkpoint.shadow_tolerance={shadow_tolerance:g}",
            "the restored learner does not reproduce the saved policy; check the code version and device, or "
            "raise checkpoint.shadow_tolerance if a different device explains the difference",
        )
    roles.rollout.update_weights(learner.export_weights())  # before the first generation
    notes = []
    if state.rollout is not None:
        if isinstance(roles.rollout, StatefulRollout):
            roles.rollout.load_state(state.rollout)
        else:
            notes.append(f"rollout backend {roles.config.rollout.backend!r} keeps no state; its sampler was "
                         "not restored, so sampling will differ from an uninterrupted run")
    restore_rng(state.rng)
    return RestoreReport(resume=ResumePoint(state.step, state.queue), shadow_max_abs_diff=drift, notes=tuple(notes))


def recover_newest(roles: Roles, store: CheckpointStore, shadow_tolerance: float) -> ResumePoint:
    """Restore a restarted learner from the newest committed checkpoint (the run's start when there is none yet).

    The overlapped driver calls it when the learner was lost mid-run; the
    save in flight either commits first or is not a checkpoint.
    """
    try:
        store.wait()
    except CheckpointError:
        pass
    committed = store.list_committed()
    if not committed:
        if isinstance(roles.learner, RestartableLearner):  # a restarted actor waits to be told
            roles.learner.accept_initial_state()
        roles.rollout.update_weights(roles.learner.export_weights())
        return ResumePoint(0)
    path, _ = committed[-1]
    return restore(roles, store.load(path), shadow_tolerance).resume


def compatibility_problems(state: CheckpointState, *, config: Mapping[str, Any] | None = None,
                           dataset_version: str | None = None, tokenizer_hash: str | None = None) -> list[str]:
    """Why resuming ``state`` with this config / data / tokenizer would not continue the same run.

    Each argument left None is not checked. Config paths in RESUME_MUTABLE_PATHS
    (total steps, logging, eval, retention) may change. The model's shape is
    checked when the learner loads the weights.
    """
    problems = []
    changes = config_changes(state.config, config, RESUME_MUTABLE_PATHS) if config is not None else []
    if changes:
        shown = ", ".join(f"{path}: {old!r} -> {new!r}" for path, old, new in changes[:6])
        more = f" and {len(changes) - 6} more" if len(changes) > 6 else ""
        problems.append(f"the config changed since checkpoint step {state.step}: {shown}{more}")
    if dataset_version is not None and dataset_version != state.dataset_version:
        problems.append(f"the dataset changed since checkpoint step {state.step}: its version was "
                        f"{state.dataset_version}, the data now hashes to {dataset_version}")
    if tokenizer_hash is not None and tokenizer_hash != state.tokenizer_hash:
        problems.append(f"the tokenizer changed since checkpoint step {state.step}: hash {state.tokenizer_hash} "
                        f"then, {tokenizer_hash} now")
    return problems


def shadow_batch(roles: Roles) -> TrainBatch:
    """The fixed shadow batch: the first train prompts followed by their reference answers."""
    import torch

    tok = roles.tokenizer
    rows = []
    for record in roles.task.train[:SHADOW_PROMPTS]:
        answer = list(tok(record.answer, add_special_tokens=False)["input_ids"])
        rows.append((list(tok(record.text)["input_ids"]), answer + ([tok.eos_token_id] if tok.eos_token_id is not None else [])))
    n, width = len(rows), max(len(p) + len(a) for p, a in rows)
    ids = torch.full((n, width), tok.pad_token_id, dtype=torch.long)  # [N, T]
    attention = torch.zeros((n, width), dtype=torch.long)  # [N, T]
    action = torch.zeros((n, width), dtype=torch.float32)  # [N, T]
    for i, (prompt, answer) in enumerate(rows):
        ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        attention[i, : len(prompt) + len(answer)] = 1
        action[i, len(prompt): len(prompt) + len(answer)] = 1.0
    return _train_batch(ids, attention, action, roles.sampling)


def shadow_drift(learner: Any, shadow: ShadowBatch) -> float:
    """Max |log-prob now - log-prob at save time| over the shadow batch's answer tokens."""
    batch = _train_batch(shadow.input_ids, shadow.attention_mask, shadow.action_mask, shadow.sampling)
    mask = shadow.action_mask > 0
    if not bool(mask.any()):
        return 0.0
    diff = float((learner.logprobs(batch).float() - shadow.logprobs)[mask].abs().max())
    return diff if math.isfinite(diff) else math.inf


def _train_batch(ids: Any, attention: Any, action: Any, sampling: Any) -> TrainBatch:
    import torch

    zeros = torch.zeros(ids.shape, dtype=torch.float32)  # [N, T]
    n = int(ids.shape[0])
    return TrainBatch(input_ids=ids, attention_mask=attention, action_mask=action, behavior_logprobs=zeros,
                      advantages=zeros, sampling=sampling, trajectory_ids=tuple(f"shadow/{i}" for i in range(n)),
                      policy_versions=(0,) * n)


def _cursor(saved: Mapping[str, int], num_records: int) -> CursorState:
    epoch, position = int(saved["epoch"]), int(saved["position"])
    if epoch < 0 or not 0 <= position <= num_records:
        raise CheckpointError(f"the saved data cursor (epoch {epoch}, position {position}) does not fit a train "
                              f"split of {num_records} prompts", "the dataset changed; resume with the original data")
    return CursorState(epoch=epoch, position=position)


def capture_rng() -> dict[str, Any]:
    """The RNG states of this process (python, numpy, torch, CUDA if used), keyed by rank."""
    import random

    import numpy as np
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return {f"rank{_rank()}": state}


def restore_rng(saved: Mapping[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    key = f"rank{_rank()}"
    if key not in saved:
        raise CheckpointError(f"the checkpoint has no RNG state for {key} (it has {', '.join(sorted(saved))})",
                              "resume with the world size the run was saved with")
    state = saved[key]
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
