"""A run's directory: its layout, its lock, its committed checkpoints and its model directories.

What this is: ``RunDir``, the only code that knows where a run's files live::

    <root>/.lock              flock held by the one process training or resuming the run
    <root>/config.json        the resolved config
    <root>/run.json           provenance (run id, hashes, seed, initial policy)
    <root>/checkpoints/       step-NNNNNN/ directories; only COMMITTED ones exist
    <root>/policy/final/      the final policy as a plain Hugging Face directory

The lock is ``fcntl.flock`` on ``.lock``: the kernel drops it when the process
dies (also SIGKILL), so a free lock on a ``running`` run means its process is
gone. Model directories are written through ``write_dir_durably`` (temporary
sibling, fsync, rename), so a reader never sees half of one.

What this is not: the checkpoint format or commit protocol
(rlctl.engine.checkpoint) or run bookkeeping in the registry (rlctl.lifecycle.run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Callable, Mapping

from rlctl.contracts.errors import CheckpointError
from rlctl.contracts.checkpoints import CheckpointManifest
from rlctl.storage.durable import write_dir_durably


class RunLock:
    """An exclusive lock on a run directory: two processes never train or resume one run at once."""

    def __init__(self, handle: IO[str]) -> None:
        self._handle = handle

    def release(self) -> None:
        import fcntl

        if not self._handle.closed:
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
            self._handle.close()


class RunDir:
    """The files of one run under ``root``."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def final_policy(self) -> Path:
        return self.root / "policy" / "final"

    @property
    def lock_path(self) -> Path:
        return self.root / ".lock"

    # -- lock ----------------------------------------------------------------------------------

    def lock(self) -> RunLock:
        """Take the run's lock or raise CheckpointError naming the process that holds it."""
        import fcntl
        import os

        self.root.mkdir(parents=True, exist_ok=True)
        handle = self.lock_path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown pid"
            handle.close()
            raise CheckpointError(f"run directory {self.root} is in use by another rlctl process ({holder})",
                                  "wait for that process to finish, or stop it; one run has one writer") from None
        handle.truncate(0)
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        return RunLock(handle)

    def lock_is_free(self) -> bool:
        """True when a lock file exists and no live process holds it (the run's process is gone)."""
        import fcntl

        if not self.lock_path.is_file():
            return False
        with self.lock_path.open("a+", encoding="utf-8") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            return True

    # -- checkpoints ---------------------------------------------------------------------------

    def committed(self) -> list[tuple[str, CheckpointManifest]]:
        """Committed checkpoints as ``(path, manifest)``, oldest first (checksums not verified)."""
        from rlctl.engine.checkpoint import DiskCheckpointStore

        return DiskCheckpointStore(self.checkpoints).list_committed()

    def newest_step(self) -> int | None:
        committed = self.committed()
        return committed[-1][1].step if committed else None

    def refuse_foreign_checkpoints(self) -> None:
        """A new run never writes into a directory that holds another run's checkpoints (they are immutable)."""
        committed = self.committed()
        if committed:
            owner = committed[-1][1].run_id
            raise CheckpointError(f"run directory {self.root} already holds checkpoints of run {owner}",
                                  f"pass a new --run-dir, or continue that run with `rlctl resume {owner}`")

    # -- files ---------------------------------------------------------------------------------

    def write_run_files(self, config: Mapping[str, object], info: Mapping[str, object]) -> None:
        """``config.json`` (the resolved config) and ``run.json`` (provenance)."""
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        (self.root / "run.json").write_text(json.dumps(info, indent=2, sort_keys=True))

    @staticmethod
    def write_model_dir(target: Path, *writers: Callable[[str], None]) -> Path:
        """Write a Hugging Face directory durably: each writer (e.g. ``save_pretrained``) fills it in turn."""

        def fill(tmp: Path) -> None:
            for write in writers:
                write(str(tmp))

        return write_dir_durably(target, fill)
