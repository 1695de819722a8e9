"""Typed payloads of checkpoints: the manifest and its files, the learner's state, the whole run's snapshot.

What this is: the frozen dataclasses a checkpoint is made of, crossing the
boundary between the learner (``LearnerState``), the loop's snapshot
(``CheckpointState``: learner, data cursor, RNG, shadow batch, provenance) and
the checkpoint store (``CheckpointManifest``: every file with its sha256, the
commit record), plus the registry's row for a committed checkpoint.

What this is not: the file format and commit protocol (rlctl.engine.checkpoint)
or the other payloads (rlctl.contracts.types, which this module builds on).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from rlctl.contracts.types import SamplingConfig

_FROZEN = dict(frozen=True, slots=True, kw_only=True)  # as every payload of rlctl.contracts.types

CHECKPOINT_FORMAT = 1


@dataclass(**_FROZEN)
class CheckpointFile:
    """One file of a checkpoint: its path relative to the checkpoint directory, sha256 and size."""

    path: str
    sha256: str
    num_bytes: int


@dataclass(**_FROZEN)
class CheckpointManifest:
    """The ``COMMITTED`` file of a checkpoint directory: what it holds and the checksum of every file.

    A checkpoint directory exists for readers only once this manifest has been
    renamed into place (rlctl.engine.checkpoint). ``step`` counts completed RL
    steps, so a resume continues with step index ``step``. The manifest carries
    its own checksum (``to_json`` / ``from_json``), so a flipped byte in it is
    caught like a flipped byte in any other file.

    >>> m = CheckpointManifest(run_id="r", step=2, policy_version=2, created_at=0.0, config_hash="c",
    ...     code_version="git:abc", dataset_version="d", tokenizer_hash="t",
    ...     files=(CheckpointFile(path="state.json", sha256="00", num_bytes=2),))
    >>> CheckpointManifest.from_json(m.to_json()) == m
    True
    """

    run_id: str
    step: int
    policy_version: int
    created_at: float
    config_hash: str
    code_version: str
    dataset_version: str
    tokenizer_hash: str
    files: tuple[CheckpointFile, ...]
    metrics: Mapping[str, float] = field(default_factory=dict)
    format_version: int = CHECKPOINT_FORMAT

    def _body(self) -> dict[str, Any]:
        body = asdict(self)
        body["files"] = [asdict(f) for f in self.files]
        body["metrics"] = dict(sorted(self.metrics.items()))
        return body

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, ASCII) with a ``manifest_sha256`` over everything else."""
        body = self._body()
        body["manifest_sha256"] = hashlib.sha256(_canonical(body).encode()).hexdigest()
        return _canonical(body)

    @classmethod
    def from_json(cls, text: str) -> "CheckpointManifest":
        """Parse and check the self-checksum; ValueError says what is wrong."""
        try:
            body = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"manifest is not valid JSON ({err})") from None
        if not isinstance(body, dict):
            raise ValueError("manifest is not a JSON object")
        claimed = body.pop("manifest_sha256", None)
        if claimed != hashlib.sha256(_canonical(body).encode()).hexdigest():
            raise ValueError("manifest checksum does not match its content")
        if body.get("format_version") != CHECKPOINT_FORMAT:
            raise ValueError(f"unknown checkpoint format {body.get('format_version')!r}")
        try:
            body["files"] = tuple(CheckpointFile(**f) for f in body["files"])
            manifest = cls(**body)
        except (KeyError, TypeError) as err:
            raise ValueError(f"manifest fields are wrong ({err})") from None
        if manifest.to_json() != text:
            raise ValueError("manifest is not in canonical form")
        return manifest


def _canonical(body: Mapping[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)


@dataclass(**_FROZEN)
class CheckpointRecord:
    """A committed checkpoint as the registry indexes it (the directory is the truth)."""

    run_id: str
    step: int
    path: str
    manifest_sha256: str
    created_at: float
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(**_FROZEN)
class LearnerState:
    """Everything a learner needs to continue bit for bit (what ``checkpoint_state`` returns).

    ``weights`` are Hugging Face state-dict names -> tensors, tied aliases
    dropped (written as ``model/model.safetensors``); ``model_files`` are the
    model's config files (name -> JSON text). ``optimizer``, ``scheduler``,
    ``grad_scaler`` and ``rng`` are the backend's ``state_dict()`` trees: any
    tensor inside is saved with safetensors, the rest as JSON (never pickle).
    ``grad_scaler`` is None when the learner uses no loss scaling.

    A sharded learner (ShardedCheckpointLearner) sets ``shard_dir``: its ranks
    have already written the weights and optimizer tensors there, each rank its
    own shard file (the checkpoint's ``shards/`` directory); ``weights`` is then
    empty and ``optimizer`` holds only the tensor-free rest (param groups). On
    load ``shard_dir`` points at the verified checkpoint's ``shards/``.
    """

    policy_version: int
    weights: Mapping[str, Any]
    model_files: Mapping[str, str]
    optimizer: Mapping[str, Any]
    scheduler: Mapping[str, Any]
    grad_scaler: Mapping[str, Any] | None = None
    rng: Mapping[str, Any] = field(default_factory=dict)
    counters: Mapping[str, int] = field(default_factory=dict)
    shard_dir: str | None = None


@dataclass(**_FROZEN)
class ShadowBatch:
    """A small fixed batch and the log-probs the policy gave it when a checkpoint was saved.

    A resume recomputes the log-probs with the restored learner and refuses to
    continue if they differ by more than ``checkpoint.shadow_tolerance``.
    """

    input_ids: Any  # [N, T] long
    attention_mask: Any  # [N, T] long
    action_mask: Any  # [N, T] float
    logprobs: Any  # [N, T] float32
    sampling: SamplingConfig


@dataclass(**_FROZEN)
class CheckpointState:
    """One consistent snapshot of a run between two steps (tensors are private copies).

    ``step`` completed steps. ``rollout`` is the rollout backend's optional
    ``state()`` tree (the core never reads it). ``cursor`` is the prompt
    cursor's ``{"epoch", "position"}``. ``rng`` holds the process RNG states per
    rank (``{"rank0": {"python", "numpy", "torch", ["cuda"]}}``). ``config`` is the
    resolved run config as JSON data; the other fields are its provenance.
    ``queue`` is the trajectory queue's cursor (rlctl.engine.queue), so a resume
    neither drops buffered trajectories nor trains on one twice.
    """

    step: int
    learner: LearnerState
    rollout: Mapping[str, Any] | None
    cursor: Mapping[str, int]
    rng: Mapping[str, Any]
    shadow: ShadowBatch
    run_id: str
    config: Mapping[str, Any]
    config_hash: str
    code_version: str
    dataset_version: str
    tokenizer_hash: str
    tokenizer_dir: str
    metrics: Mapping[str, float] = field(default_factory=dict)
    critic: Mapping[str, Any] | None = None  # the critic backend's state() tree, when the run has a critic
    queue: Mapping[str, Any] | None = None  # the trajectory queue's consumption cursor (overlapped modes only)
