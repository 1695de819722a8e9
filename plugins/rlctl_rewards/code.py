"""The "code" reward: run a completion's Python against the row's unit tests in the sandbox.

What this is: code extraction (``extract_code``: the last fenced block, a
python-labelled one first, else the raw text), test parsing (``parse_tests``),
and ``CodeReward``, which runs the candidate plus tests in one jailed
``python3 -I -S`` (rlctl_rewards.sandbox) and scores the fraction of tests
passed (or 1.0 only when all pass, ``score: all``).

The reference (the task row's ``answer``) holds the tests, either as Python
source or as a JSON list of statements (MBPP's ``test_list``). Top-level
``assert`` statements and ``def test_*()`` functions are tests; every other
top-level statement (imports, helpers) is setup run before them.

Grader tampering: results never come from stdout (the candidate's prints go to
stderr) but from nonce-tagged records; a missing record is a failed test, a
repeated one voids the test, so exiting early is never a pass. For a test of
the form ``assert EXPR == LITERAL`` the expected value never enters the jail:
the jail sends back EXPR's value, encoded only if it is made of plain built-in
types (no ``__eq__`` tricks, no subclasses), and the comparison happens here.
Other tests report pass/fail from inside the jail, so a program that digs
the nonce out of the harness's memory could forge them; prefer value tests.

Outcomes: "passed" / "failed" (with counts) are scores. A program past the
wall clock, the output cap or the memory cap failed (``on_timeout: exclude``
flags timeouts instead). A jail that cannot start is ``error_code
"sandbox_error"``, never a zero.

What this is not: a general judge (no stdin/stdout problems yet) or a sandbox
(rlctl_rewards.sandbox).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlctl import RewardResult, Trajectory
from rlctl_rewards.sandbox import Limits, RunResult, Sandbox, SandboxUnavailable

VERSION = "1.0"

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The program in a completion: the last ```python block, else the last fenced block, else the text."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    python = [body for lang, body in blocks if lang in ("python", "py", "python3")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return text


@dataclass(frozen=True)
class Test:
    """One unit test: ``kind`` "value" (jail returns ``src``'s value, compared to ``expected`` here),
    "assert" (a statement) or "call" (a test function's name)."""

    kind: Literal["value", "assert", "call"]
    src: str
    expected: Any = None
    label: str = ""


class BadTestsError(ValueError):
    """The reference is not usable as tests."""


def parse_tests(reference: str) -> tuple[str, list[Test]]:
    """(setup source, tests) from a reference: Python source, or a JSON list of statements."""
    source = reference
    stripped = reference.strip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError:
            items = None
        if isinstance(items, list) and all(isinstance(x, str) for x in items):
            source = "\n".join(items)
    try:
        module = ast.parse(source)
    except SyntaxError as err:
        raise BadTestsError(f"the tests are not valid Python ({err.msg}, line {err.lineno})") from None
    setup, tests = [], []
    for node in module.body:
        if isinstance(node, ast.Assert):
            tests.append(_assert_test(node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            setup.append(ast.unparse(ast.fix_missing_locations(_StrictEq().visit(node))))
            tests.append(Test("call", node.name, label=node.name))
        else:
            setup.append(ast.unparse(node))
    if not tests:
        raise BadTestsError("the reference holds no tests (top-level assert statements or def test_*)")
    return "\n".join(setup), tests


def _assert_test(node: ast.Assert) -> Test:
    text = ast.unparse(node)
    test = node.test
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        left, right = test.left, test.comparators[0]
        for expr, lit in ((left, right), (right, left)):
            try:
                expected = ast.literal_eval(lit)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            if _encode(expected) is not None:
                return Test("value", ast.unparse(expr), expected, label=text)
    return Test("assert", ast.unparse(ast.fix_missing_locations(_StrictEq().visit(node))), label=text)


class _StrictEq(ast.NodeTransformer):
    """``assert a == b`` -> ``assert __rlctl_same__(a, b)``: exact built-in types, no ``__eq__`` overrides."""

    def visit_Assert(self, node: ast.Assert) -> ast.Assert:
        test = node.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            node.test = ast.Call(func=ast.Name("__rlctl_same__", ast.Load()),
                                 args=[test.left, test.comparators[0]], keywords=[])
        return node


def _encode(value: Any, depth: int = 0) -> Any:
    """A JSON form of plain built-in data, exact types only; None when anything else is inside."""
    kind = type(value)
    if depth > 50:
        return None
    if value is None or kind is bool or kind is str:
        return [kind.__name__, value]
    if kind is int:
        return ["int", str(value)] if abs(value) < 10**4000 else None
    if kind is float:
        return ["float", repr(value)]
    if kind is complex:
        return ["complex", [repr(value.real), repr(value.imag)]]
    if kind in (list, tuple):
        items = [_encode(v, depth + 1) for v in value]
        return None if any(i is None for i in items) else [kind.__name__, items]
    if kind in (set, frozenset):
        items = [_encode(v, depth + 1) for v in value]
        return None if any(i is None for i in items) else [kind.__name__, sorted(json.dumps(i) for i in items)]
    if kind is dict:
        pairs = [(_encode(k, depth + 1), _encode(v, depth + 1)) for k, v in value.items()]
        if any(k is None or v is None for k, v in pairs):
            return None
        return ["dict", sorted([json.dumps(k), v] for k, v in pairs)]
    return None


def _same(got: Any, want: Any) -> bool:
    """Encoded values equal, with int/float compared by value (``assert f() == 3`` accepts 3.0)."""
    if not (isinstance(got, list) and len(got) == 2 and isinstance(want, list)):
        return False
    (gk, gv), (wk, wv) = got, want
    if gk in ("int", "float") and wk in ("int", "float"):
        try:
            a = int(gv) if gk == "int" else float(gv)
            b = int(wv) if wk == "int" else float(wv)
        except (TypeError, ValueError):
            return False
        return a == b and not (isinstance(a, float) and math.isnan(a))
    if gk != wk:
        return False
    if gk in ("list", "tuple"):
        return isinstance(gv, list) and len(gv) == len(wv) and all(_same(g, w) for g, w in zip(gv, wv))
    if gk == "dict":
        if not isinstance(gv, list) or len(gv) != len(wv):
            return False
        return all(isinstance(g, list) and len(g) == 2 and g[0] == w[0] and _same(g[1], w[1])
                   for g, w in zip(gv, wv))
    return gv == wv


# Runs inside the jail as ``python3 -I -S -c RUNNER``; the job arrives on stdin.
# Records go to a private copy of stdout; the candidate's fd 1 is pointed at stderr.
RUNNER = r'''
import json, os, sys
_job = json.loads(sys.stdin.buffer.read())
sys.stdin.close()
_nonce, _fd = _job["nonce"], os.dup(1)
os.dup2(2, 1)
_write, _dumps = os.write, json.dumps
def _rec(**kw):
    kw["n"] = _nonce
    _write(_fd, (_dumps(kw) + "\n").encode())
def _enc(value, depth=0):
    k = type(value)
    if depth > 50: return None
    if value is None or k is bool or k is str: return [k.__name__, value]
    if k is int: return ["int", str(value)] if abs(value) < 10**4000 else None
    if k is float: return ["float", repr(value)]
    if k is complex: return ["complex", [repr(value.real), repr(value.imag)]]
    if k in (list, tuple):
        items = [_enc(v, depth + 1) for v in value]
        return None if any(i is None for i in items) else [k.__name__, items]
    if k in (set, frozenset):
        items = [_enc(v, depth + 1) for v in value]
        return None if any(i is None for i in items) else [k.__name__, sorted(_dumps(i) for i in items)]
    if k is dict:
        pairs = [(_enc(a, depth + 1), _enc(b, depth + 1)) for a, b in value.items()]
        if any(a is None or b is None for a, b in pairs): return None
        return ["dict", sorted([_dumps(a), b] for a, b in pairs)]
    return None
def _same(a, b):
    num = (int, float)
    if type(a) in num and type(b) in num: return a == b
    ea, eb = _enc(a), _enc(b)
    if ea is not None and eb is not None: return ea == eb
    return type(a) is type(b) and type(a).__eq__ is object.__eq__ and a == b
def _why(err):
    return (type(err).__name__ + ": " + str(err))[:300]
_rec(ready=True)
_ns = {"__name__": "solution", "__builtins__": __builtins__}
try:
    exec(compile(_job["code"], "solution.py", "exec"), _ns)
    _loaded = None
except BaseException as err:
    _loaded = "solution raised " + _why(err)
if _loaded is None:
    try:
        exec(compile(_job["setup"], "tests.py", "exec"), _ns)
    except BaseException as err:
        _loaded = "test setup raised " + _why(err)
for _i, _t in enumerate(_job["tests"]):
    if _loaded is not None:
        _rec(i=_i, ok=False, error=_loaded)
        continue
    _ns["__rlctl_same__"] = _same
    try:
        if _t["kind"] == "value":
            _v = _enc(eval(compile(_t["src"], "tests.py", "eval"), _ns))
            if _v is None:
                _rec(i=_i, ok=False, error="value is not plain built-in data")
            else:
                _rec(i=_i, ok=True, value=_v)
        elif _t["kind"] == "assert":
            exec(compile(_t["src"], "tests.py", "exec"), _ns)
            _rec(i=_i, ok=True)
        else:
            _ns[_t["src"]]()
            _rec(i=_i, ok=True)
    except BaseException as err:
        try:
            _rec(i=_i, ok=False, error=_why(err))
        except BaseException:
            _rec(i=_i, ok=False, error="unprintable error")
_rec(done=True)
'''


@dataclass(frozen=True)
class Verdict:
    """How one program did: status, per-test outcome, and what the jail reported."""

    status: Literal["passed", "failed", "timeout", "sandbox_error"]
    passed: int
    total: int
    detail: str
    run: RunResult | None = None


def judge(sandbox: Sandbox, code: str, setup: str, tests: list[Test]) -> Verdict:
    """Run ``code`` + tests in ``sandbox``; never raises for what the program does."""
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "code": code, "setup": setup,
           "tests": [{"kind": t.kind, "src": t.src} for t in tests]}
    try:
        run = sandbox.run([sandbox.python, "-I", "-S", "-c", RUNNER], json.dumps(job).encode())
    except SandboxUnavailable as err:
        return Verdict("sandbox_error", 0, len(tests), str(err))
    records: dict[int, list[dict[str, Any]]] = {}
    ready = False
    for line in run.stdout.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            continue
        if not isinstance(rec, dict) or rec.get("n") != nonce:
            continue
        ready |= rec.get("ready") is True
        if isinstance(rec.get("i"), int):
            records.setdefault(rec["i"], []).append(rec)
    if not ready:
        return Verdict("sandbox_error", 0, len(tests),
                       f"the jailed harness never started ({run.status}, exit {run.returncode}): "
                       f"{run.stderr.decode(errors='replace')[-300:].strip()}", run)
    passed, first_error = 0, ""
    for i, test in enumerate(tests):
        got = records.get(i, [])
        if len(got) != 1:
            first_error = first_error or (f"test {i}: no result" if not got else f"test {i}: {len(got)} results")
            continue
        rec = got[0]
        ok = rec.get("ok") is True
        if ok and test.kind == "value":
            ok = _same(rec.get("value"), _encode(test.expected))
            if not ok:
                first_error = first_error or f"{test.label[:120]}: got {str(rec.get('value'))[:80]}"
                continue
        if ok:
            passed += 1
        else:
            first_error = first_error or f"{test.label[:120]}: {str(rec.get('error'))[:200]}"
    if run.status == "timeout":
        return Verdict("timeout", passed, len(tests), f"wall-clock limit {sandbox.limits.wall_s}s", run)
    if passed == len(tests):  # every test has exactly one good record: how the process ended is moot
        return Verdict("passed", passed, len(tests), "", run)
    why = first_error or {"output_limit": "output cap exceeded"}.get(run.status, f"exit {run.returncode}")
    if run.oom_killed:
        why = f"memory cap ({sandbox.limits.memory_mb} MiB) hit; {why}"
    return Verdict("failed", passed, len(tests), why, run)


class CodeOptions(BaseModel):
    """Options of the "code" reward."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    score: Literal["fraction", "all"] = Field(
        "fraction", description='"fraction": tests passed / tests; "all": 1.0 only when every test passes')
    on_timeout: Literal["fail", "exclude"] = Field(
        "fail", description='"fail": a program past the wall clock scores like a failure (its finished tests '
        'count); "exclude": flag it as error_code "timeout" so it is left out of the advantage')
    wall_s: float = Field(10.0, gt=0, le=600, description="wall-clock limit of one program, enforced outside")
    cpu_s: int = Field(10, ge=1, le=600, description="CPU-time limit (RLIMIT_CPU)")
    memory_mb: int = Field(512, ge=64, le=65536, description="memory cap (cgroup and RLIMIT_AS)")
    pids: int = Field(32, ge=4, le=4096, description="process cap (cgroup pids.max), bwrap's own included")
    output_kib: int = Field(1024, ge=1, le=65536, description="stdout/stderr cap per stream; past it the run is killed")
    python: str = Field("/usr/bin/python3", description="interpreter inside the jail (world-executable, under /usr)")
    program: str = Field(
        "{code}", description='the program run: "{code}" is replaced by the extracted code, e.g. '
        '"answer = {code}" when completions are expressions')
    tests: str = Field(
        "{reference}", description='the tests: "{reference}" is replaced by the row\'s answer, e.g. '
        '"assert answer == {reference}" when the answer is a value, not test code')

    @field_validator("program")
    @classmethod
    def _has_code(cls, value: str) -> str:
        if "{code}" not in value:
            raise ValueError('program must contain "{code}" (where the completion\'s code goes)')
        return value

    @field_validator("tests")
    @classmethod
    def _has_reference(cls, value: str) -> str:
        if "{reference}" not in value:
            raise ValueError('tests must contain "{reference}" (where the row\'s answer goes)')
        return value


class CodeReward:
    """Fraction (or all) of the row's unit tests the completion's code passes, in the sandbox."""

    name = "code"

    def __init__(self, options: CodeOptions | None = None) -> None:
        self.options = o = options or CodeOptions()
        self.sandbox = Sandbox(Limits(wall_s=o.wall_s, cpu_s=o.cpu_s, memory_mb=o.memory_mb, pids=o.pids,
                                      output_bytes=o.output_kib << 10), python=o.python)
        self.version = f"code@{VERSION}+{o.score}+{self.fingerprint()}"
        self.sandbox.check()  # fail at startup, with the fix, not on the first sample

    def fingerprint(self) -> str:
        """A hash of everything that decides a verdict besides the code under test: the program and test
        templates, scoring rules, interpreter, every sandbox limit, the jail's flags and the in-jail harness."""
        o = self.options
        graded = {"program": o.program, "tests": o.tests, "score": o.score, "on_timeout": o.on_timeout,
                  "python": o.python, "limits": asdict(self.sandbox.limits), "jail": self.sandbox.bwrap_args(),
                  "harness": hashlib.sha256(RUNNER.encode()).hexdigest()}
        return hashlib.sha256(json.dumps(graded, sort_keys=True).encode()).hexdigest()[:12]

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["options"])  # type: ignore[misc]

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        started = time.perf_counter()
        try:
            setup, tests = parse_tests(self.options.tests.replace("{reference}", reference))
        except BadTestsError as err:
            return self._result(0.0, started, f"bad reference: {err}", error="invalid_reference")
        code = self.options.program.replace("{code}", extract_code(trajectory.response_text))
        verdict = judge(self.sandbox, code, setup, tests)
        log = f"{verdict.status} {verdict.passed}/{verdict.total}" + (f": {verdict.detail}" if verdict.detail else "")
        if verdict.status == "sandbox_error":
            return self._result(0.0, started, log, error="sandbox_error")
        if verdict.status == "timeout" and self.options.on_timeout == "exclude":
            return self._result(0.0, started, log, error="timeout")
        if self.options.score == "all":
            value = 1.0 if verdict.status == "passed" else 0.0
        else:
            value = verdict.passed / verdict.total
        return self._result(value, started, log)

    def _result(self, value: float, started: float, log: str, error: str | None = None) -> RewardResult:
        return RewardResult(total=value, components={} if error else {"code": value}, grader_version=self.version,
                            error_code=error, latency_s=time.perf_counter() - started, log=log)
