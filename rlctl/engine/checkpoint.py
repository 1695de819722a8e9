"""Immutable checkpoint directories with an atomic COMMITTED manifest: save, verify, load, retain.

Layout of one checkpoint, ``<run_dir>/checkpoints/step-000123/`` (123 = completed steps):

    model/model.safetensors    policy weights; model/ is a Hugging Face directory
    model/config.json, ...     model config files and the tokenizer files
    optimizer.safetensors      the optimizer's tensors
    state.safetensors          every other tensor: RNG states per rank, backend generators
    state.json                 step, policy version, LR schedule, optimizer structure, data
                               cursor, python/numpy RNG, resolved config and its hash, code
                               version, dataset version, tokenizer hash, the step's metrics
    shadow.safetensors         a fixed shadow batch and the log-probs it had at save time
    COMMITTED                  the manifest (CheckpointManifest): sha256 and size of every file

A sharded learner's checkpoint (rlctl.engine.shards) has no model/model.safetensors:
its ranks write ``shards/*.safetensors`` (weights and optimizer tensors, each rank
its own piece, torch.distributed.checkpoint's safetensors layout) before the save
starts, into the directory ``stage_shards`` hands out; the save then fsyncs,
checksums and lists them in the same manifest. ``export_hf`` consolidates them.

Commit protocol (``save``). Each file is written under its final name, fsynced,
read back and compared with the sha256 of the bytes that were meant to be
written. Then the directories are fsynced, the manifest is written to
``COMMITTED.tmp`` and fsynced, renamed to ``COMMITTED``, and the directory and
its parent are fsynced. Only after that does ``on_commit`` run (the caller adds
the registry row), and then retention. A directory without ``COMMITTED`` does
not exist to any reader; ``cleanup_partial`` removes it. Retention deletes an
old checkpoint's ``COMMITTED`` first (fsync), then its registry row (through
``on_delete``), then its files. It runs only after a newer checkpoint is
committed, so at least one committed checkpoint always survives, also with
``keep_last=1``.

Saves run in a background thread with at most one in flight: ``save`` first
waits for the previous one. A failed save removes its directory and is
re-raised by the next ``save``, ``wait`` or ``close``. ``close(abort=True)``
abandons the save in flight at the next file boundary and removes its
directory.

Crash points for fault-injection tests (rlctl.engine.faults, ``RLCTL_CRASH_AT``),
in protocol order: ``ckpt.file_partial:<file>`` (half of a file written),
``ckpt.file_written:<file>``, ``ckpt.manifest_tmp``, ``ckpt.renamed`` (before the
directory fsync), ``ckpt.dir_synced`` (before the registry row),
``ckpt.registry_row`` (before retention), ``ckpt.retention_unlinked:<dir>`` (an
old checkpoint's manifest removed, its files still there) and
``ckpt.retention_partial:<dir>`` (some of its files removed).

Loading reads tensors with safetensors and everything else as JSON: nothing is
unpickled, so a checkpoint from an untrusted path cannot run code.

What this is not: deciding what goes into a checkpoint and restoring a run's roles
from it (rlctl.engine.snapshot), or the registry (the caller passes callbacks).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

from rlctl.contracts.errors import CheckpointError
from rlctl.contracts.checkpoints import CheckpointManifest, CheckpointState
from rlctl.engine.checkpoint_files import (
    SHARDS, file_problem, payload, read_state, shard_files, write_bytes, write_file,
)
from rlctl.storage.durable import fsync_path, write_dir_durably
from rlctl.engine.faults import crash_point, fault_site

COMMITTED = "COMMITTED"
_TMP_MANIFEST = "COMMITTED.tmp"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
REQUIRED_FILES = ("model/model.safetensors", "model/config.json", "optimizer.safetensors", "state.safetensors",
                  "state.json", "shadow.safetensors")
SHARDED_REQUIRED_FILES = tuple(f for f in REQUIRED_FILES if f != "model/model.safetensors")
FALLBACK_HINT = "a resume falls back to the previous committed checkpoint"

OnCommit = Callable[[str, CheckpointManifest], None]
Warn = Callable[[str], None]


class _SaveAborted(Exception):
    """close(abort=True) stopped a save between two files."""


def step_dir_name(step: int) -> str:
    """``step-000123``: the directory of the checkpoint taken after ``step`` completed steps."""
    return f"step-{step:06d}"


def manifest_sha256(manifest: CheckpointManifest) -> str:
    """sha256 of the ``COMMITTED`` file's bytes (the manifest is stored in canonical form)."""
    return hashlib.sha256(manifest.to_json().encode()).hexdigest()


class DiskCheckpointStore:
    """The CheckpointStore on a local (or mounted) file system; see the module docstring."""

    def __init__(self, root: str | Path, *, keep_last: int = 2, keep_best_metric: str | None = None,
                 keep_best_mode: str = "max", async_save: bool = True, on_commit: OnCommit | None = None,
                 on_delete: OnCommit | None = None, warn: Warn | None = None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (got {keep_last}): a run always keeps a committed checkpoint")
        self.root = Path(root)
        self.keep_last, self.keep_best_metric, self.keep_best_mode = keep_last, keep_best_metric, keep_best_mode
        self.async_save = async_save
        self.on_commit, self.on_delete = on_commit, on_delete
        self.warn = warn or (lambda message: None)
        self._thread: threading.Thread | None = None
        self._writing: Path | None = None
        self._error: tuple[str, BaseException] | None = None
        self._abort = threading.Event()

    # -- writing -------------------------------------------------------------

    def save(self, state: CheckpointState) -> str:
        """Start writing ``state`` (in the background when ``async_save``); return its directory."""
        self.wait()
        target = self.root / step_dir_name(state.step)
        if (target / COMMITTED).exists():
            raise CheckpointError(f"checkpoint {target} is already committed and checkpoints are immutable",
                                  "another rlctl process may be writing this run; stop it first")
        self._abort.clear()
        self._writing = target
        if not self.async_save:
            self._write_and_record(state, target)
            self.wait()
            return str(target)
        self._thread = threading.Thread(target=self._write_and_record, args=(state, target),
                                        name=f"rlctl-checkpoint-{state.step}")
        self._thread.start()
        return str(target)

    def stage_shards(self, step: int) -> str:
        """An empty ``shards/`` inside step ``step``'s checkpoint directory, for a sharded learner's ranks.

        Waits for the save in flight first. The directory stays uncommitted (and
        is removed by ``cleanup_partial`` after a crash) until ``save`` of the
        same step lists the shard files in its manifest.
        """
        self.wait()
        target = self.root / step_dir_name(step)
        if (target / COMMITTED).exists():
            raise CheckpointError(f"checkpoint {target} is already committed and checkpoints are immutable",
                                  "another rlctl process may be writing this run; stop it first")
        if target.exists():
            shutil.rmtree(target)
        (target / SHARDS).mkdir(parents=True)
        self._writing = target
        return str(target / SHARDS)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save in flight is committed; re-raise its failure as CheckpointError."""
        if self._thread is not None:
            if self._thread.ident is not None:  # an interrupt may land between creating and starting it
                self._thread.join()
            self._thread = None
        if self._error is not None:
            (name, err), self._error = self._error, None
            raise CheckpointError(f"saving checkpoint {name} failed: {type(err).__name__}: {err}",
                                  "the previous committed checkpoint is intact; free space or fix the "
                                  "file system, then `rlctl resume` the run") from err

    def close(self, abort: bool = False) -> None:
        """Finish the save in flight, or with ``abort`` abandon it cleanly (its directory is removed).

        A KeyboardInterrupt while waiting (a second Ctrl-C) aborts the save, waits
        for the writer to stop and re-raises.
        """
        if abort:
            self._abort.set()
        try:
            self.wait()
        except KeyboardInterrupt:
            self._abort.set()
            self.wait()
            raise

    def _write_and_record(self, state: CheckpointState, target: Path) -> None:
        try:
            self._write(state, target)
        except _SaveAborted:
            self.warn(f"checkpoint {target.name} was abandoned at shutdown; the previous one stays the newest")
        except Exception as err:  # handed to the training thread by wait()
            self._error = (target.name, err)
        finally:
            self._writing = None

    def _write(self, state: CheckpointState, target: Path) -> None:
        committed = False
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shards = state.learner.shard_dir
            if shards is not None and Path(shards) != target / SHARDS:
                raise ValueError(f"the learner wrote its shards to {shards}, not to {target / SHARDS} "
                                 "(stage_shards of this step)")
            if target.exists() and shards is None:  # a partial directory left by a killed save: never read
                shutil.rmtree(target)
            (target / "model").mkdir(parents=True)
            files = [] if shards is None else shard_files(target)
            for rel, data in payload(state):
                self._check_abort()
                files.append(write_file(target, rel, data))
            for directory in (target / "model", *([target / SHARDS] if shards else []), target, self.root):
                fsync_path(directory)
            manifest = CheckpointManifest(
                run_id=state.run_id, step=state.step, policy_version=state.learner.policy_version,
                created_at=time.time(), config_hash=state.config_hash, code_version=state.code_version,
                dataset_version=state.dataset_version, tokenizer_hash=state.tokenizer_hash, files=tuple(files),
                metrics={k: float(v) for k, v in state.metrics.items()},
            )
            self._check_abort()
            write_bytes(target / _TMP_MANIFEST, manifest.to_json().encode())
            crash_point("ckpt.manifest_tmp")
            os.rename(target / _TMP_MANIFEST, target / COMMITTED)
            committed = True
            crash_point("ckpt.renamed")
            fsync_path(target)
            fsync_path(self.root)
            crash_point("ckpt.dir_synced")
        except BaseException:
            if not committed:
                shutil.rmtree(target, ignore_errors=True)
            raise
        self._notify(self.on_commit, target, manifest, "record")
        fault_site("checkpoint.committed", path=str(target), step=state.step)  # bit rot after commit (injected)
        crash_point("ckpt.registry_row")
        self.apply_retention()

    def _check_abort(self) -> None:
        if self._abort.is_set():
            raise _SaveAborted()

    def _notify(self, callback: OnCommit | None, path: Path, manifest: CheckpointManifest, verb: str) -> None:
        if callback is None:
            return
        try:
            callback(str(path), manifest)
        except Exception as err:  # the directory is the truth; a resume reconciles the index
            self.warn(f"could not {verb} checkpoint {path.name} in the registry ({err}); "
                      "`rlctl resume` reconciles the registry with the checkpoint directory")

    # -- retention and cleanup -------------------------------------------------

    def apply_retention(self) -> list[str]:
        """Delete committed checkpoints beyond the newest ``keep_last`` (and the best one); return their names."""
        committed = self.list_committed()
        keep = {path for path, _ in committed[-self.keep_last:]}
        best = self._best(committed)
        if best is not None:
            keep.add(best)
        deleted = []
        for path, manifest in committed:
            if path not in keep:
                self._delete(Path(path), manifest)
                deleted.append(Path(path).name)
        return deleted

    def best_committed(self) -> str | None:
        """The committed checkpoint kept for the best ``keep_best_metric`` (None: off, or none recorded it)."""
        return self._best(self.list_committed())

    def _best(self, committed: list[tuple[str, CheckpointManifest]]) -> str | None:
        name = self.keep_best_metric
        scored = [(m.metrics[name], m.step, p) for p, m in committed
                  if name and name in m.metrics and m.metrics[name] == m.metrics[name]]  # skip NaN
        if not scored:
            return None
        sign = 1 if self.keep_best_mode == "max" else -1
        return max(scored, key=lambda s: (sign * s[0], s[1]))[2]

    def _delete(self, path: Path, manifest: CheckpointManifest) -> None:
        (path / COMMITTED).unlink()  # first: from here on no reader sees this checkpoint
        fsync_path(path)
        crash_point("ckpt.retention_unlinked", path.name)
        self._notify(self.on_delete, path, manifest, "remove")
        doomed = sorted((p for p in path.rglob("*") if p.is_file()), reverse=True)
        for i, file in enumerate(doomed):
            file.unlink()
            if i == 0:
                crash_point("ckpt.retention_partial", path.name)
        shutil.rmtree(path)
        fsync_path(self.root)

    def cleanup_partial(self) -> list[str]:
        """Remove step directories without a committed manifest (left by a killed save or deletion)."""
        removed = []
        for path in self._step_dirs():
            if not (path / COMMITTED).is_file() and path != self._writing:
                shutil.rmtree(path)
                removed.append(path.name)
        if removed:
            fsync_path(self.root)
        return removed

    # -- reading -----------------------------------------------------------------

    def _step_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return [p for _, p in sorted(found)]

    def _committed_dirs(self) -> list[Path]:
        return [p for p in self._step_dirs() if (p / COMMITTED).is_file()]

    def list_committed(self) -> list[tuple[str, CheckpointManifest]]:
        """``(path, manifest)`` of every committed checkpoint with a readable manifest, oldest first."""
        out = []
        for path in self._committed_dirs():
            try:
                out.append((str(path), read_manifest(path)))
            except CheckpointError:
                continue  # unreadable manifest: treated as corrupt by load_latest, never deleted here
        return out

    def load(self, path: str) -> CheckpointState:
        return load_checkpoint(path)

    def load_latest(self) -> tuple[str, CheckpointState, list[str]]:
        """The newest checkpoint that verifies, plus one warning per newer one that did not.

        Newer unusable checkpoints are moved to ``<root>/corrupt/`` (kept for
        inspection, out of the way of the steps about to be re-run). If
        checkpoints exist but none verifies, CheckpointError: a run never
        silently restarts at step 0.
        """
        dirs = self._committed_dirs()
        if not dirs:
            raise CheckpointError(f"no committed checkpoint in {self.root}",
                                  "the run stopped before its first checkpoint (checkpoint.every_steps); "
                                  "start it again with `rlctl train`")
        problems: list[tuple[Path, str]] = []
        for path in reversed(dirs):
            try:
                state = load_checkpoint(path)
            except CheckpointError as err:
                problems.append((path, err.message))
                continue
            warnings = [f"skipped checkpoint {bad.name}: {why}; moved it to {self._quarantine(bad)}"
                        for bad, why in problems]
            return str(path), state, warnings
        detail = "; ".join(why for _, why in problems)
        raise CheckpointError(f"{len(dirs)} committed checkpoint(s) in {self.root} exist but none verifies: {detail}",
                              "refusing to restart at step 0; restore the files from a backup, or start a "
                              "new run with `rlctl train`")

    def _quarantine(self, path: Path) -> Path:
        target = self.root / "corrupt" / f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}"
        target.parent.mkdir(exist_ok=True)
        os.rename(path, target)
        fsync_path(self.root)
        return target


def read_manifest(path: str | Path) -> CheckpointManifest:
    """The parsed, self-checked ``COMMITTED`` manifest of the checkpoint at ``path``."""
    path = Path(path)
    where = path / COMMITTED
    try:
        text = where.read_text(encoding="ascii")
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {COMMITTED} manifest, so it was never committed",
                              "only committed checkpoints can be loaded") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{COMMITTED}: unreadable ({err})", FALLBACK_HINT) from None
    try:
        manifest = CheckpointManifest.from_json(text)
    except ValueError as err:
        raise CheckpointError(f"{COMMITTED}: {err}", FALLBACK_HINT) from None
    named = _STEP_DIR.match(path.name)
    if named and int(named.group(1)) != manifest.step:
        raise CheckpointError(f"{COMMITTED}: names step {manifest.step} but lives in {path.name}", FALLBACK_HINT)
    listed = {f.path for f in manifest.files}
    for f in manifest.files:
        if Path(f.path).is_absolute() or ".." in Path(f.path).parts:
            raise CheckpointError(f"{COMMITTED}: file path {f.path!r} leaves the checkpoint directory", FALLBACK_HINT)
    sharded = any(p.startswith(SHARDS + "/") for p in listed)
    for required in SHARDED_REQUIRED_FILES if sharded else REQUIRED_FILES:
        if required not in listed:
            raise CheckpointError(f"{COMMITTED}: does not list the required file {required}", FALLBACK_HINT)
    return manifest


def verify(path: str | Path) -> CheckpointManifest:
    """Check the manifest and every file's size and sha256; CheckpointError names every bad file."""
    path = Path(path)
    manifest = read_manifest(path)
    problems = [p for f in manifest.files if (p := file_problem(path, f)) is not None]
    if problems:
        raise CheckpointError(f"{path.name}: {'; '.join(problems)}", FALLBACK_HINT)
    return manifest


def load_checkpoint(path: str | Path) -> CheckpointState:
    """Verify the checkpoint at ``path`` and read it back (safetensors and JSON only)."""
    path = Path(path)
    manifest = verify(path)
    try:
        return read_state(path, manifest)
    except (KeyError, TypeError, ValueError, OSError) as err:
        raise CheckpointError(f"{path.name}: verifies but cannot be read ({type(err).__name__}: {err})",
                              FALLBACK_HINT) from err


def export_hf(path: str | Path, target: str | Path) -> Path:
    """Copy the verified model of a checkpoint into ``target`` as a plain Hugging Face directory."""
    path, target = Path(path), Path(target)
    manifest = verify(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(f"export target {target} exists and is not an empty directory",
                              "choose a new directory for --hf")
    def fill(tmp: Path) -> None:
        for f in manifest.files:
            if f.path.startswith("model/"):
                data = (path / f.path).read_bytes()
                if hashlib.sha256(data).hexdigest() != f.sha256:
                    raise CheckpointError(f"{f.path} changed while exporting", "retry the export")
                write_bytes(tmp / f.path[len("model/"):], data)
        if any(f.path.startswith(SHARDS + "/") for f in manifest.files):  # consolidate the ranks' pieces
            from safetensors.torch import save

            from rlctl.engine.shards import read_full_model

            write_bytes(tmp / "model.safetensors", save(read_full_model(path / SHARDS), metadata={"format": "pt"}))

    write_dir_durably(target, fill)
    return target
