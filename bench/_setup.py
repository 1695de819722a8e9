"""Common setup every benchmark runs first: one torch thread, offline, quiet, repo importable.

Imported for its side effects before torch: ``import _setup`` then ``from _setup import REPO``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 threads on a shared 2-core box can run 100x slower
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "plugins"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
import transformers  # noqa: E402

transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
