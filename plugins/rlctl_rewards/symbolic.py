"""Symbolic equivalence of two answer strings with sympy, safely and with a time bound.

What this is: a whitelist gate (``eligible``), a parser that never reaches Python
builtins (``safe_parse``), the in-process check (``sympy_equal``) and a time-bounded
wrapper (``equal_bounded``) that runs the check in one long-lived helper process
(``python -m rlctl_rewards.symbolic``) which is killed and replaced when a check
runs past its deadline. Big-integer arithmetic ("9^9^9") cannot be interrupted
inside a Python thread, so only a separate process gives a real bound.

What this is not: answer extraction or normalisation (rlctl_rewards.math). Model
output is untrusted: strings are never passed to ``eval``/``sympify`` directly.
Unparseable input is "not equivalent" (with a note), never an error.
"""

from __future__ import annotations

import atexit
import json
import re
import select
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

MAX_CHARS = 200
# Lowercase letters, digits, arithmetic and parentheses only: no quotes, no
# underscores (no dunders), no brackets, commas, colons or "=".
_WHITELIST = re.compile(r"[0-9a-z+\-*/^(). ]+")
# A "." is only a decimal point: digit-free dots would allow attribute access.
_BAD_DOT = re.compile(r"(?<![0-9])\.|\.(?![0-9])")
_STARTUP_TIMEOUT_S = 60.0
_WORKER_MEMORY_BYTES = 2 << 30


class SymbolicTimeout(Exception):
    """A symbolic check ran past its deadline; the helper process was replaced."""


def eligible(text: str) -> bool:
    """True when ``text`` is short and made only of whitelisted characters."""
    return (
        0 < len(text) <= MAX_CHARS
        and _WHITELIST.fullmatch(text) is not None
        and _BAD_DOT.search(text) is None
    )


def _namespace() -> dict[str, Any]:
    """The only names a parsed expression can reach: a few sympy objects, no builtins."""
    import sympy

    names: dict[str, Any] = {"__builtins__": {}}
    for name in ("Symbol", "Integer", "Float", "Rational", "Function"):
        names[name] = getattr(sympy, name)
    names.update(
        sqrt=sympy.sqrt, sin=sympy.sin, cos=sympy.cos, tan=sympy.tan, exp=sympy.exp,
        log=sympy.log, ln=sympy.log, abs=sympy.Abs, pi=sympy.pi, e=sympy.E,
    )
    return names


def safe_parse(text: str) -> Any:
    """Parse a whitelisted string into a sympy expression; ValueError if not eligible."""
    if not eligible(text):
        raise ValueError(f"not a whitelisted expression: {text[:40]!r}")
    from sympy.parsing.sympy_parser import (
        auto_number,
        auto_symbol,
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
    )

    transformations = (auto_symbol, auto_number, convert_xor, implicit_multiplication_application)
    return parse_expr(text, local_dict={}, global_dict=_namespace(), transformations=transformations)


def sympy_equal(a: str, b: str) -> tuple[bool, str]:
    """``simplify(a - b) == 0`` in this process, without a time bound. Returns (equal, note)."""
    import sympy

    try:
        left, right = safe_parse(a), safe_parse(b)
        if not isinstance(left, sympy.Expr) or not isinstance(right, sympy.Expr):
            return False, "not an expression"
        return bool(sympy.simplify(left - right) == 0), "sympy"
    # Untrusted text: sympy raises many types on bad input, each means "not equal".
    except (ValueError, TypeError, SyntaxError, AttributeError, ArithmeticError,
            RecursionError, MemoryError, sympy.SympifyError) as err:
        return False, f"unparseable ({type(err).__name__})"


# The helper's whole environment: nothing of the parent's (no tokens, no keys) leaks into it.
_HELPER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def helper_command(package_parent: str) -> list[str]:
    """``python -m rlctl_rewards.symbolic``, inside bubblewrap when it is installed.

    The jail (no network, read-only binds of only the interpreter, its packages
    and this package, a private /tmp, no capabilities, an empty environment)
    costs about 15 ms once per helper start, not per check. Without bwrap the
    helper still gets the empty environment; its input is whitelisted
    arithmetic, so the jail is a second wall, not the only one.
    """
    argv = [sys.executable, "-m", "rlctl_rewards.symbolic"]
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return argv
    binds: list[str] = []
    paths = {sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent.parent), package_parent}
    paths |= {p for p in sys.path if p and Path(p).is_dir() and not p.startswith("/usr")}
    for path in sorted(paths):
        if not path.startswith("/usr") and Path(path).exists():
            binds += ["--ro-bind", path, path]
    return [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
            *[x for k, v in (_HELPER_ENV | {"PYTHONPATH": package_parent}).items() for x in ("--setenv", k, v)],
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            # the binds after the private /tmp, so an interpreter or checkout under /tmp stays visible
            *binds, "--chdir", "/tmp", "--remount-ro", "/", *argv]


class _Worker:
    """One helper process answering JSON-line requests; restarted after a timeout."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def check(self, a: str, b: str, timeout_s: float) -> tuple[bool, str]:
        with self._lock:
            proc = self._ensure()
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"a": a, "b": b}) + "\n")
            proc.stdin.flush()
            line = self._read_line(proc, timeout_s)
            if line is None:
                self._kill()
                raise SymbolicTimeout(f"sympy check exceeded {timeout_s}s: {a[:40]!r} vs {b[:40]!r}")
            reply = json.loads(line)
            return bool(reply["equal"]), str(reply["note"])

    def _ensure(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        package_parent = str(Path(__file__).resolve().parent.parent)
        self._proc = subprocess.Popen(
            helper_command(package_parent), cwd="/", env=_HELPER_ENV | {"PYTHONPATH": package_parent},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True,
        )
        if self._read_line(self._proc, _STARTUP_TIMEOUT_S) != "ready":
            self._kill()
            raise RuntimeError("the sympy helper process did not start (see its stderr above)")
        return self._proc

    def _read_line(self, proc: subprocess.Popen[str], timeout_s: float) -> str | None:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = proc.stdout.readline()
        if not line:
            code = proc.wait()
            self._proc = None
            raise RuntimeError(f"the sympy helper process exited with code {code}")
        return line.strip()

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the helper process, if one is running."""
        with self._lock:
            self._kill()


_WORKER: _Worker | None = None
_WORKER_LOCK = threading.Lock()


def equal_bounded(a: str, b: str, timeout_s: float) -> tuple[bool, str]:
    """``sympy_equal`` in the helper process; raise SymbolicTimeout past ``timeout_s``."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = _Worker()
        worker = _WORKER
    return worker.check(a, b, timeout_s)


def _serve() -> None:
    """Helper-process loop: read {"a","b"} lines, answer {"equal","note"} lines."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_BYTES, _WORKER_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):  # not POSIX, or a lower hard limit: keep it
        pass
    import sympy  # noqa: F401  (import before "ready" so startup is not billed to a check)

    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        equal, note = sympy_equal(request["a"], request["b"])
        print(json.dumps({"equal": equal, "note": note}), flush=True)


if __name__ == "__main__":
    _serve()
