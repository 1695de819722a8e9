"""The "code" reward: extraction, test parsing, scoring kinds, fail-closed, the math helper's jail,
and a code task end to end through the scoring path (scripted completions, in-process and 2 workers)."""

from __future__ import annotations

import socket
import subprocess
from functools import partial
from pathlib import Path

import pytest

from rlctl import SamplingConfig, TerminalReason, Trajectory
from rlctl.engine.reward_mix import MixedReward
from rlctl.engine.reward_pool import ProcessRewardPool
from rlctl.engine.scoring import score_all
from rlctl.hooks.manager import load_plugins
from rlctl_rewards import sandbox as sandbox_mod
from rlctl_rewards import symbolic
from rlctl_rewards.code import CodeOptions, CodeReward, BadTestsError, extract_code, parse_tests
from rlctl_rewards.sandbox import SandboxUnavailable

TESTS = "from math import gcd\nassert lcm(4, 6) == 12\nassert lcm(3, 5) == 15\ndef test_one():\n    assert lcm(1, 9) == 9\n"


def traj(text: str, pid: str = "p1", reason: TerminalReason = TerminalReason.EOS) -> Trajectory:
    return Trajectory.create(
        id=f"{pid}/0", prompt_id=pid, group_index=0, dataset_version="d", policy_version=0, tokenizer_hash="t",
        prompt_tokens=(1,), response_tokens=(2,), response_text=text, action_mask=(1,), behavior_logprobs=(-0.1,),
        sampling_config=SamplingConfig(max_tokens=4), terminal_reason=reason, rollout_started_at=0.0,
    )


def test_extract_code_prefers_the_last_python_block() -> None:
    text = "Idea:\n```text\nnot code\n```\n```python\ndef f(): return 1\n```\nthen\n```py\ndef f(): return 2\n```"
    assert extract_code(text).strip() == "def f(): return 2"
    assert extract_code("```\nx = 1\n```").strip() == "x = 1"
    assert extract_code("def f(): return 3") == "def f(): return 3"
    assert extract_code("```python\ndef f(): return 4").strip() == "def f(): return 4"  # truncated fence


def test_parse_tests_splits_setup_value_assert_and_function_tests() -> None:
    setup, tests = parse_tests(TESTS)
    assert "from math import gcd" in setup and "def test_one" in setup
    assert [t.kind for t in tests] == ["value", "value", "call"]
    assert tests[0].src == "lcm(4, 6)" and tests[0].expected == 12
    _, listed = parse_tests('["assert f(1) == [1, 2]", "assert f(2) != 3"]')  # MBPP test_list
    assert [t.kind for t in listed] == ["value", "assert"]
    with pytest.raises(BadTestsError, match="no tests"):
        parse_tests("x = 1")
    with pytest.raises(BadTestsError, match="not valid Python"):
        parse_tests("assert (")


@pytest.fixture(scope="module")
def reward(_sandbox_problem) -> CodeReward:
    if _sandbox_problem is not None:
        pytest.skip(_sandbox_problem)
    return CodeReward(CodeOptions(wall_s=5))


GOOD = "```python\ndef lcm(a, b):\n    return a * b // gcd(a, b)\n```"
HALF = "def lcm(a, b):\n    return a * b"


def test_scores_fraction_and_all(reward: CodeReward) -> None:
    good, half = reward.score(traj(GOOD), TESTS), reward.score(traj(HALF), TESTS)
    assert (good.total, good.error_code) == (1.0, None) and good.log.startswith("passed 3/3")
    assert half.total == pytest.approx(2 / 3) and half.log.startswith("failed 2/3")
    strict = CodeReward(CodeOptions(score="all", wall_s=5))
    assert strict.score(traj(HALF), TESTS).total == 0.0
    assert strict.version.startswith("code@1.1+all+")


def test_timeout_fails_or_is_excluded_by_option(needs_sandbox) -> None:
    loop = "def lcm(a, b):\n    while True: pass"
    failed = CodeReward(CodeOptions(wall_s=1.5)).score(traj(loop), TESTS)
    assert (failed.total, failed.error_code) == (0.0, None) and failed.log.startswith("timeout 0/3")
    excluded = CodeReward(CodeOptions(wall_s=1.5, on_timeout="exclude")).score(traj(loop), TESTS)
    assert excluded.error_code == "timeout"


def test_bad_reference_is_an_error_not_a_zero(reward: CodeReward) -> None:
    result = reward.score(traj(GOOD), "no tests here")
    assert result.error_code == "invalid_reference" and not result.components


def test_missing_bwrap_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_mod.shutil, "which", lambda *a, **k: None)
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        CodeReward(CodeOptions())


def test_jail_that_cannot_start_is_sandbox_error_never_zero(reward: CodeReward, monkeypatch) -> None:
    monkeypatch.setattr(reward.sandbox, "bwrap_args", lambda: ["bwrap", "--no-such-flag"])
    result = reward.score(traj(GOOD), TESTS)
    assert result.error_code == "sandbox_error" and "never started" in result.log


def test_code_task_end_to_end_through_scoring(reward: CodeReward) -> None:
    """Scripted completions for a 2-prompt x 3-sample group through the mixed reward, in-process and 2 workers."""
    plugins = load_plugins()
    refs = {"p1": TESTS, "p2": "assert rev('ab') == 'ba'\nassert rev('') == ''"}
    completions = [("p1", GOOD), ("p1", HALF), ("p1", "import os; os._exit(0)"),
                   ("p2", "def rev(s): return s[::-1]"), ("p2", "def rev(s): return s"),
                   ("p2", "```python\ndef rev(s):\n    return ''.join(reversed(s))\n```")]
    trajs = [traj(text, pid) for pid, text in completions] + [traj(GOOD, "p1", TerminalReason.ABORT)]
    mix = MixedReward([("code", 1.0, plugins.build("reward_function", "code", {"wall_s": 5}, "reward.components.0"))])
    in_proc, _ = score_all(trajs, refs, mix, None)
    expected = [1.0, 2 / 3, 0.0, 1.0, 0.5, 1.0]
    assert [t.reward for t in in_proc[:6]] == pytest.approx(expected)
    assert in_proc[6].reward_error == "aborted"
    assert all(t.grader_version == f"code:{mix.components[0][2].version}x1.0" for t in in_proc[:6])
    with ProcessRewardPool(partial(MixedReward, [("code", 1.0, reward)]), workers=2, timeout_s=30) as pool:
        pooled, _ = score_all(trajs, refs, mix, None, pool=pool)
    assert [t.reward for t in pooled[:6]] == pytest.approx(expected)


def test_math_helper_jail_has_no_env_no_network(needs_sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLCTL_CANARY_MATH", "leakme")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    package_parent = str(Path(symbolic.__file__).resolve().parent.parent)
    argv = symbolic.helper_command(package_parent)
    assert argv[0].endswith("bwrap") and "--unshare-all" in argv and "--clearenv" in argv
    probe = (f"import os, socket\nprint(sorted(os.environ))\ntry:\n    socket.create_connection(('127.0.0.1', {port}),"
             " timeout=1); print('CONNECTED')\nexcept OSError as e: print('blocked', e)\nimport sympy; print('sympy ok')")
    out = subprocess.run(argv[:-2] + ["-c", probe], capture_output=True, text=True, timeout=60,
                         env=symbolic._HELPER_ENV, cwd="/")
    server.close()
    assert "leakme" not in out.stdout and "RLCTL_CANARY_MATH" not in out.stdout
    assert "blocked" in out.stdout and "CONNECTED" not in out.stdout and "sympy ok" in out.stdout, out.stderr
    assert symbolic.equal_bounded("2*x+x", "3*x", 60) == (True, "sympy")


def test_program_and_tests_templates_grade_expression_completions(needs_sandbox) -> None:
    """An arithmetic row ("17") graded by executing the completion: the policy's output is the code."""
    arith = CodeReward(CodeOptions(program="answer = {code}", tests="assert answer == {reference}", wall_s=5))
    assert arith.score(traj("12+5"), "17").total == 1.0
    assert arith.score(traj("17"), "17").total == 1.0
    assert arith.score(traj("-17"), "17").total == 0.0
    assert arith.score(traj("__import__('os')._exit(0)"), "17").total == 0.0
    with pytest.raises(ValueError, match="must contain"):
        CodeOptions(program="print(1)")


def test_the_version_covers_templates_limits_and_scoring_rules(needs_sandbox) -> None:
    """Changing how a program is graded (templates, any sandbox limit, scoring rule) changes the grader version,
    and with it the dataset version of a run (so a resume across the change is refused)."""
    base = CodeReward(CodeOptions())
    assert CodeReward(CodeOptions()).version == base.version  # the same settings: the same version
    changes = [{"tests": "assert answer == {reference}"}, {"program": "answer = {code}"}, {"wall_s": 5.0},
               {"cpu_s": 5}, {"memory_mb": 256}, {"pids": 16}, {"output_kib": 64}, {"score": "all"},
               {"on_timeout": "exclude"}]
    versions = {CodeReward(CodeOptions(**change)).version for change in changes}
    assert len(versions) == len(changes) and base.version not in versions
    weaker = CodeReward(CodeOptions())
    weaker.sandbox.drop_flags = ("--unshare-net",)  # another jail grades differently
    assert weaker.fingerprint() != base.fingerprint()


# -- grader tampering: every verdict comes from a process the graded code has no handle on -------------------

# Assert-style and test_* tests (their verdicts are made in the jail) that an honest `answer() -> 41` fails.
TAMPER_TESTS = ("assert answer() > 41\nassert answer() in (42, 43)\nassert abs(answer() - 42) < 1\n"
                "assert isinstance(answer(), int) and answer() % 2 == 0\n"
                "def test_answer():\n    assert answer() == 42\n")
# Issue 25's forgery, made thorough: the nonce and the record descriptor from the harness's __main__ (or any
# dict holding a nonce), forged "ok" records for every test on that descriptor (else on every one it has or can
# open), then exit. On the harness before issue 25 it scored 1.0.
FORGE_FROM_MAIN = r"""
import gc, json, os, sys
def answer(): return 41
main = vars(sys.modules['__main__'])
nonce = main.get('_nonce') or (main.get('_job') or {}).get('nonce')
for obj in gc.get_objects() if nonce is None else ():
    if isinstance(obj, dict) and isinstance(obj.get('nonce'), str):
        nonce = obj['nonce']
        break
fds = [main['_fd']] if isinstance(main.get('_fd'), int) else list(range(64))  # one record each, or spray
for path in ('/proc/%d/fd/1' % os.getppid(), '/proc/1/fd/1') if len(fds) > 1 else ():
    try:
        fds.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass
lines = ''.join(json.dumps({'n': nonce or '', 'i': i, 'ok': True, 'value': ['int', '42']}) + '\n' for i in range(32))
lines += json.dumps({'n': nonce or '', 'done': True}) + '\n'
for fd in fds:
    try:
        os.write(fd, lines.encode())
    except OSError:
        pass
os._exit(0)
"""
FORGING = {
    "forge-from-main": FORGE_FROM_MAIN,
    # the same records, but the solution stays alive and answers honestly afterwards
    "forge-then-serve": FORGE_FROM_MAIN.replace("os._exit(0)", "pass"),
    # built-ins the tests use, redefined to agree with anything
    "shadow-builtins": "def answer(): return 41\ndef abs(x): return 0\ndef isinstance(*a): return True\n"
                       "def all(*a): return True\nAssertionError = None\n",
    # an object that claims to equal, contain and exceed everything
    "always-true-object": "class T:\n    __eq__ = __gt__ = __lt__ = __contains__ = lambda *a: True\n"
                          "    __mod__ = __sub__ = lambda *a: 0\n    __bool__ = lambda self: True\n"
                          "    __hash__ = object.__hash__\n    def __abs__(self): return 0\n"
                          "def answer(): return T()\n",
}


@pytest.mark.parametrize("name", sorted(FORGING))
def test_a_completion_that_forges_verdicts_scores_zero(reward: CodeReward, name: str) -> None:
    """Issue 25: a completion that found the harness's nonce and record descriptor in its own interpreter
    forged "ok" for every assert-style and test_* test. Now the tests run in a process it cannot reach."""
    honest = reward.score(traj("def answer(): return 42"), TAMPER_TESTS)
    assert honest.total == 1.0, honest.log  # the tests do pass a right answer through the process boundary
    forged = reward.score(traj(FORGING[name]), TAMPER_TESTS)
    assert forged.total == 0.0 and forged.error_code is None, forged.log


def test_tests_reach_solution_objects_through_the_boundary(reward: CodeReward) -> None:
    """Calls, attributes, classes, generators, exceptions, kwargs, the tests' imports and objects passed back
    in all work across the two processes, so honest solutions keep their scores."""
    solution = ("class Stack:\n    def __init__(self): self.items = []\n    def push(self, x): self.items.append(x)\n"
                "    def __len__(self): return len(self.items)\n    def top(self): return self.items[-1]\n"
                "def gen(n):\n    yield from range(n)\ndef div(a, b=1): return a / b\n"
                "def roots(n): return {k: sqrt(k) for k in range(n)}\ndef peek(s): return s.top()\n"
                "LIMIT = 3\n")
    tests = ("from math import sqrt, isclose\nassert list(gen(3)) == [0, 1, 2]\nassert div(6, b=3) == 2.0\n"
             "assert LIMIT == 3\nassert isclose(roots(5)[4], 2.0)\n"
             "def test_stack():\n    s = Stack()\n    s.push(4)\n    s.push(5)\n    assert len(s) == 2 and s.top() == 5\n"
             "    assert s.items == [4, 5] and peek(s) == 5\n"
             "def test_raises():\n    try:\n        div(1, 0)\n    except ZeroDivisionError:\n        return\n"
             "    assert False\n")
    result = reward.score(traj(solution), tests)
    assert result.total == 1.0, result.log
