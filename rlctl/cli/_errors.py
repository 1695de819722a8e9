"""The one place exceptions become output: a table of exception type -> exit code.

Known errors (RlctlError) print one line plus a hint to stderr and exit 1.
Usage errors exit 2 (typer/click handle those). ``--debug`` or
``RLCTL_DEBUG=1`` adds the traceback. Unknown exceptions keep their traceback:
bugs should look like bugs.
"""

from __future__ import annotations

import os
import sys
import traceback

from rlctl.contracts.errors import RlctlError

EXIT_CODES: dict[type[BaseException], int] = {RlctlError: 1, KeyboardInterrupt: 130}


def debug_enabled() -> bool:
    return os.environ.get("RLCTL_DEBUG") == "1"


def report(err: BaseException) -> int:
    """Print ``err`` for a user and return the exit code."""
    code = next((c for t, c in EXIT_CODES.items() if isinstance(err, t)), None)
    if code is None:
        raise err
    if debug_enabled():
        traceback.print_exception(err, file=sys.stderr)
    if isinstance(err, KeyboardInterrupt):
        print("interrupted: the run is marked 'interrupted' in the registry", file=sys.stderr)
    else:
        print(f"error: {err.message}", file=sys.stderr)
        if err.hint:
            print(f"hint: {err.hint}", file=sys.stderr)
    return code
