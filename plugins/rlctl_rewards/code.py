"""The "code" reward: run a completion's Python against the row's unit tests in the sandbox.

What this is: code extraction (``extract_code``: the last fenced block, a
python-labelled one first, else the raw text), test parsing (``parse_tests``),
and ``CodeReward``, which runs the candidate and its tests in one jail
(rlctl_rewards.sandbox; ``python3 -I -S``, the candidate and the tests in two
processes, see below) and scores the fraction of tests passed (or 1.0 only
when all pass, ``score: all``).

The reference (the task row's ``answer``) holds the tests, either as Python
source or as a JSON list of statements (MBPP's ``test_list``). Top-level
``assert`` statements and ``def test_*()`` functions are tests; every other
top-level statement (imports, helpers) is setup run before them.

Grader tampering -- the property: **every verdict comes from a process the
graded code has no handle on.** In the jail, the harness
(rlctl_rewards.jail_harness) forks the solution into its own process before
it learns the job, so the solution never holds the tests, the nonce, or a
descriptor of the stream verdicts travel on, and cannot read the harness's
memory (it is non-dumpable). The tests run in the harness process and reach
the solution only through a pipe that carries plain data (exact built-in
types) and calls on the solution's objects; equality is never asked of the
solution, and names it defines that shadow built-ins are dropped. So a
program that exits early, prints sentinels, writes forged records to every
descriptor it has, or searches its own memory for the harness scores as
what it is: a missing or failed test. Verdicts are nonce-tagged records on
the harness's stdout; a missing record is a failed test, a repeated one
voids it. For a test of the form ``assert EXPR == LITERAL`` the expected
value never enters the jail at all: the harness sends back EXPR's value and
the comparison happens here.

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
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlctl import RewardResult, Trajectory
from rlctl_rewards import jail_harness
from rlctl_rewards.sandbox import Limits, RunResult, Sandbox, SandboxUnavailable

VERSION = "1.1"  # 1.1: dict arguments and values keep their insertion order through the jail

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


def _encode(value: Any) -> Any:
    """A JSON form of plain built-in data, exact types only; None when anything else is inside."""
    return jail_harness.enc(value, None)


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
    if gk == "dict":  # pairs in insertion order; equal dicts need not share it
        if not isinstance(gv, list) or len(gv) != len(wv) or not all(isinstance(g, list) and len(g) == 2 for g in gv):
            return False
        gv, wv = sorted(gv, key=lambda p: str(p[0])), sorted(wv, key=lambda p: str(p[0]))
        return all(g[0] == w[0] and _same(g[1], w[1]) for g, w in zip(gv, wv))
    return gv == wv


# The in-jail harness (rlctl_rewards.jail_harness), run as ``python3 -I -S -c HARNESS``; the job arrives on stdin.
HARNESS = Path(jail_harness.__file__).read_text()


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
    imports = "\n".join(ast.unparse(node) for node in ast.parse(setup).body
                         if isinstance(node, (ast.Import, ast.ImportFrom)))
    job = {"nonce": nonce, "code": code, "setup": setup, "imports": imports,
           "tests": [{"kind": t.kind, "src": t.src} for t in tests]}
    try:
        run = sandbox.run([sandbox.python, "-I", "-S", "-c", HARNESS], json.dumps(job).encode())
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
        templates, scoring rules, interpreter, every sandbox limit, the jail's flags and seccomp filter and the
        in-jail harness."""
        o = self.options
        graded = {"program": o.program, "tests": o.tests, "score": o.score, "on_timeout": o.on_timeout,
                  "python": o.python, "limits": asdict(self.sandbox.limits), "jail": self.sandbox.bwrap_args(),
                  "seccomp": (self.sandbox.seccomp() or b"").hex(),
                  "harness": hashlib.sha256(HARNESS.encode()).hexdigest()}
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
