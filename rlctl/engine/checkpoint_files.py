"""A checkpoint directory's files: the state written as files, read back, and each file written durably.

What this is: ``payload`` (a CheckpointState as ``(relative path, bytes)``:
the model, optimizer and state safetensors plus the state JSON, produced one
at a time to bound memory), ``read_state`` (the verified files back into a
CheckpointState; tensors only through safetensors, never pickle), the
durable single-file write with its sha256, the checksum of a sharded
learner's files, and the check of one file against its manifest entry.

What this is not: the commit protocol, retention and the store's API
(rlctl.engine.checkpoint).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

from rlctl.contracts.checkpoints import CheckpointFile, CheckpointManifest, CheckpointState, LearnerState, ShadowBatch
from rlctl.contracts.types import SamplingConfig
from rlctl.engine import state_codec
from rlctl.engine.faults import crash_point
from rlctl.storage.durable import fsync_path

STATE_FORMAT = 1
SHARDS = "shards"  # a sharded learner's directory inside a checkpoint

# -- file format -------------------------------------------------------------------


def payload(state: CheckpointState) -> Iterator[tuple[str, bytes]]:
    """``(relative path, bytes)`` of every file, produced one at a time to bound memory."""
    from safetensors.torch import save

    from rlctl.models.tokenizer import TOKENIZER_FILES

    learner = state.learner
    if learner.shard_dir is None:
        yield "model/model.safetensors", save(dict(learner.weights), metadata={"format": "pt"})
    for name, text in sorted(learner.model_files.items()):
        yield f"model/{name}", text.encode()
    for name in TOKENIZER_FILES:
        source = Path(state.tokenizer_dir) / name
        if source.is_file():
            yield f"model/{name}", source.read_bytes()
    optimizer_tensors: dict[str, Any] = {}
    optimizer = state_codec.encode(learner.optimizer, "optimizer", optimizer_tensors)
    yield "optimizer.safetensors", save(optimizer_tensors)
    tensors: dict[str, Any] = {}
    body = {
        "format": STATE_FORMAT, "step": state.step, "run_id": state.run_id, "config": state.config,
        "config_hash": state.config_hash, "code_version": state.code_version,
        "dataset_version": state.dataset_version, "tokenizer_hash": state.tokenizer_hash,
        "learner": {
            "policy_version": learner.policy_version, "model_files": sorted(learner.model_files),
            "optimizer": optimizer, "scheduler": state_codec.encode(learner.scheduler, "scheduler", tensors),
            "grad_scaler": state_codec.encode(learner.grad_scaler, "grad_scaler", tensors),
            "rng": state_codec.encode(learner.rng, "learner_rng", tensors), "counters": dict(learner.counters),
            "sharded": learner.shard_dir is not None,
        },
        "rollout": state_codec.encode(state.rollout, "rollout", tensors),
        "critic": state_codec.encode(state.critic, "critic", tensors),
        "cursor": dict(state.cursor), "rng": state_codec.encode(state.rng, "rng", tensors),
        "shadow": {"sampling": dataclasses.asdict(state.shadow.sampling)}, "metrics": dict(state.metrics),
        "queue": None if state.queue is None else dict(state.queue),
    }
    yield "state.safetensors", save(tensors)
    yield "state.json", json.dumps(body, sort_keys=True, indent=1).encode()
    shadow = state.shadow
    yield "shadow.safetensors", save({"input_ids": shadow.input_ids, "attention_mask": shadow.attention_mask,
                                      "action_mask": shadow.action_mask, "logprobs": shadow.logprobs})


def read_state(path: Path, manifest: CheckpointManifest) -> CheckpointState:
    from safetensors.torch import load_file

    body = json.loads((path / "state.json").read_text(encoding="utf-8"))
    if body.get("format") != STATE_FORMAT:
        raise ValueError(f"state.json has format {body.get('format')!r}, expected {STATE_FORMAT}")
    tensors = {**load_file(path / "optimizer.safetensors"), **load_file(path / "state.safetensors")}
    lrn = body["learner"]
    sharded = bool(lrn.get("sharded", False))
    if sharded != any(f.path.startswith(SHARDS + "/") for f in manifest.files):
        raise ValueError(f"state.json says sharded={sharded} but the manifest lists "
                         f"{'no' if sharded else 'some'} {SHARDS}/ files")
    learner = LearnerState(
        policy_version=int(lrn["policy_version"]),
        weights={} if sharded else load_file(path / "model" / "model.safetensors"),
        shard_dir=str(path / SHARDS) if sharded else None,
        model_files={name: (path / "model" / name).read_text(encoding="utf-8") for name in lrn["model_files"]},
        optimizer=state_codec.decode(lrn["optimizer"], tensors),
        scheduler=state_codec.decode(lrn["scheduler"], tensors),
        grad_scaler=state_codec.decode(lrn["grad_scaler"], tensors),
        rng=state_codec.decode(lrn["rng"], tensors), counters=lrn["counters"],
    )
    shadow = load_file(path / "shadow.safetensors")
    sampling = dict(body["shadow"]["sampling"], stop=tuple(body["shadow"]["sampling"]["stop"]))
    return CheckpointState(
        step=int(body["step"]), learner=learner, rollout=state_codec.decode(body["rollout"], tensors),
        cursor=body["cursor"], rng=state_codec.decode(body["rng"], tensors),
        shadow=ShadowBatch(input_ids=shadow["input_ids"], attention_mask=shadow["attention_mask"],
                           action_mask=shadow["action_mask"], logprobs=shadow["logprobs"],
                           sampling=SamplingConfig(**sampling)),
        run_id=body["run_id"], config=body["config"], config_hash=body["config_hash"],
        code_version=body["code_version"], dataset_version=body["dataset_version"],
        tokenizer_hash=body["tokenizer_hash"], tokenizer_dir=str(path / "model"), metrics=body["metrics"],
        critic=state_codec.decode(body.get("critic"), tensors),  # absent in checkpoints from before critics
        queue=body.get("queue"),
    )


# -- durable file operations -----------------------------------------------------


def write_file(root: Path, rel: str, data: bytes) -> CheckpointFile:
    """Write, fsync, read back and compare: the file is exactly ``data`` on disk."""
    digest = hashlib.sha256(data).hexdigest()
    path = root / rel
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        half = len(view) // 2
        write_all(fd, view[:half])
        crash_point("ckpt.file_partial", rel)
        write_all(fd, view[half:])
        os.fsync(fd)
    finally:
        os.close(fd)
    crash_point("ckpt.file_written", rel)
    if sha256_file(path) != digest:
        raise OSError(f"{rel} reads back differently from what was written")
    return CheckpointFile(path=rel, sha256=digest, num_bytes=len(data))


def shard_files(target: Path) -> list[CheckpointFile]:
    """The files a sharded learner's ranks wrote into ``target/shards``: fsynced, sized and checksummed."""
    found = sorted(p for p in (target / SHARDS).rglob("*") if p.is_file())
    if not found:
        raise ValueError(f"the learner wrote no shard files into {target / SHARDS}")
    out = []
    for path in found:
        fsync_path(path)
        rel = path.relative_to(target).as_posix()
        crash_point("ckpt.file_written", rel)
        out.append(CheckpointFile(path=rel, sha256=sha256_file(path), num_bytes=path.stat().st_size))
    return out


def write_bytes(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]



def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_problem(root: Path, f: CheckpointFile) -> str | None:
    path = root / f.path
    if not path.is_file():
        return f"{f.path}: missing"
    size = path.stat().st_size
    if size != f.num_bytes:
        return f"{f.path}: {size} bytes but the manifest says {f.num_bytes} (truncated or overwritten)"
    if sha256_file(path) != f.sha256:
        return f"{f.path}: sha256 mismatch (corrupted)"
    return None
