"""Durability primitive shared by checkpoints and weight publishing.

What this is: ``fsync_path``, which flushes a file's data or a directory's
entries (Linux flushes the inode through any descriptor), the step every
commit protocol here needs between "written" and "visible"; and
``write_dir_durably``, the one writer of whole directories (model
directories: the final policy, an exported checkpoint, the warm start).

What this is not: a commit protocol (rlctl.engine.checkpoint and
rlctl.engine.transports.disk each own theirs).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def fsync_path(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_dir_durably(target: Path | str, fill: Callable[[Path], None]) -> Path:
    """Create directory ``target`` atomically and durably: all or nothing, also across a power loss.

    ``fill(tmp)`` writes the files into a temporary sibling; then every file and
    the directory are fsynced, the directory is renamed onto ``target`` (an
    existing ``target`` is replaced) and the parent is fsynced. This is the one
    writer of model directories (final policy, checkpoint export, warm start),
    so a reader never sees a half-written one.
    """
    import shutil

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        fill(tmp)
        for path in sorted(tmp.rglob("*"), reverse=True):  # files first, then their directories
            fsync_path(path)
        fsync_path(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
        fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
