"""Where a run's code came from: git sha + dirty flag, or the installed package version."""

from __future__ import annotations

import subprocess
from pathlib import Path


def code_version() -> str:
    """``git:<sha>[+dirty]`` when rlctl runs from a git checkout, else ``rlctl==<version>``."""
    from rlctl import __version__

    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists():
        try:
            sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                 text=True, timeout=5, check=True).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5, check=True).stdout.strip()
            return f"git:{sha}{'+dirty' if dirty else ''}"
        except (OSError, subprocess.SubprocessError):
            pass
    return f"rlctl=={__version__}"
