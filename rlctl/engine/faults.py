"""Named crash points: the fault-injection hook that tests use to SIGKILL rlctl at a chosen boundary.

What this is: ``crash_point(point, detail)``, called at every write boundary
of the checkpoint commit protocol (rlctl.engine.checkpoint). When the
environment variable ``RLCTL_CRASH_AT`` names that boundary, the process
kills itself with SIGKILL: no cleanup handler, no flush, exactly like a power
cut of the process (recovery is tested against real faults, not simulated ones).

    RLCTL_CRASH_AT=POINT[:DETAIL][@N]

POINT is a boundary name (e.g. ``ckpt.manifest_tmp``); DETAIL, if given, must
equal the boundary's detail (e.g. a file name); N (default 1) fires on the
N-th time this process reaches the matching boundary. The boundaries are
listed in rlctl.engine.checkpoint's docstring.

What this is not: a user-facing setting. It is a test hook; this function is
the only place in the engine that reads the environment, and it does nothing
when the variable is unset.
"""

from __future__ import annotations

import os
import signal
import threading

_counts: dict[str, int] = {}
_lock = threading.Lock()


def crash_point(point: str, detail: str = "") -> None:
    """SIGKILL this process if ``RLCTL_CRASH_AT`` names this boundary (test / fault-injection hook)."""
    spec = os.environ.get("RLCTL_CRASH_AT")
    if not spec:
        return
    target, _, nth = spec.partition("@")
    want_point, _, want_detail = target.partition(":")
    if want_point != point or (want_detail and want_detail != detail):
        return
    with _lock:
        _counts[target] = seen = _counts.get(target, 0) + 1
    if seen == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
