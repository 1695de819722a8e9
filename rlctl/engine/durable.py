"""Durability primitive shared by checkpoints and weight publishing.

What this is: ``fsync_path``, which flushes a file's data or a directory's
entries (Linux flushes the inode through any descriptor), the step every
commit protocol here needs between "written" and "visible".

What this is not: a commit protocol (rlctl.engine.checkpoint and
rlctl.engine.transports.disk each own theirs).
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
