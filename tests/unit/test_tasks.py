"""Built-in task sources (plugins/rlctl_tasks): the synthetic ``arith`` task and ``jsonl`` files."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rlctl import PromptRecord, Split, TaskData
from rlctl.contracts.errors import ConfigError, DataError
from rlctl.contracts.roles import TaskSource
from rlctl_tasks.arith import ArithOptions, ArithTask, _evaluate, dataset_version
from rlctl_tasks.jsonl import JsonlOptions, JsonlTask

SMALL = dict(num_terms=2, max_operand=20, ops="+-*", num_train=60, num_dev=15, num_hidden=25)


def python_value(expr: str) -> int:
    """Value of ``expr`` by Python's own grammar and integer arithmetic (an AST walk, no eval)."""
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise AssertionError(f"unexpected node {ast.dump(node)} in {expr!r}")

    return walk(ast.parse(expr, mode="eval").body)


def prompts(data: TaskData, split: Split) -> set[str]:
    return {r.text for r in data.split(split)}


# -- arith: determinism and versions ----------------------------------------------------------


def test_arith_is_a_task_source() -> None:
    assert isinstance(ArithTask(ArithOptions(**SMALL)), TaskSource)


def test_arith_is_deterministic_from_its_seed() -> None:
    first = ArithTask(ArithOptions(**SMALL, seed=7)).load()
    second = ArithTask(ArithOptions(**SMALL, seed=7)).load()
    assert first == second  # same version and the same records, in the same order
    assert first.version == second.version


def test_arith_different_seed_gives_other_data_and_version() -> None:
    a = ArithTask(ArithOptions(**SMALL, seed=1)).load()
    b = ArithTask(ArithOptions(**SMALL, seed=2)).load()
    assert a.version != b.version
    assert a.train != b.train


def test_arith_run_seed_does_not_change_the_dataset() -> None:
    # The dataset has its own seed (task.options.seed); run.seed must not reshuffle the splits.
    opts = ArithOptions(**SMALL)
    assert ArithTask(opts, seed=0).load() == ArithTask(opts, seed=99).load()


def test_arith_version_covers_the_options() -> None:
    base = ArithTask(ArithOptions(**SMALL)).load().version
    assert ArithTask(ArithOptions(**{**SMALL, "num_train": 61})).load().version != base
    assert ArithTask(ArithOptions(**{**SMALL, "max_operand": 21})).load().version != base


def test_dataset_version_depends_on_split_assignment() -> None:
    rec = PromptRecord(id="x", text="1+1=", answer="2", split=Split.TRAIN)
    as_train = {Split.TRAIN: (rec,), Split.DEV: (), Split.HIDDEN: ()}
    as_hidden = {Split.TRAIN: (), Split.DEV: (), Split.HIDDEN: (rec,)}
    assert dataset_version("t", {}, as_train) != dataset_version("t", {}, as_hidden)
    assert dataset_version("t", {}, as_train) == dataset_version("t", {}, dict(as_train))
    assert dataset_version("t", {}, as_train) != dataset_version("u", {}, as_train)
    assert dataset_version("t", {"a": 1}, as_train) != dataset_version("t", {"a": 2}, as_train)


# -- arith: splits ------------------------------------------------------------------------------


def test_arith_split_sizes_and_ids() -> None:
    data = ArithTask(ArithOptions(**SMALL)).load()
    assert data.name == "arith"
    assert (len(data.train), len(data.dev), len(data.hidden)) == (60, 15, 25)
    for split in Split:
        records = data.split(split)
        assert all(r.split is split for r in records)
        assert len({r.id for r in records}) == len(records)


def test_arith_hidden_is_disjoint_from_train_and_dev() -> None:
    data = ArithTask(ArithOptions(**SMALL)).load()
    assert not prompts(data, Split.HIDDEN) & prompts(data, Split.TRAIN)
    assert not prompts(data, Split.HIDDEN) & prompts(data, Split.DEV)
    assert not prompts(data, Split.DEV) & prompts(data, Split.TRAIN)
    assert len(prompts(data, Split.TRAIN)) == len(data.train)  # no duplicates inside a split either


def test_arith_default_options_load() -> None:
    data = ArithTask().load()
    assert (len(data.train), len(data.dev), len(data.hidden)) == (4000, 300, 500)
    assert not prompts(data, Split.HIDDEN) & (prompts(data, Split.TRAIN) | prompts(data, Split.DEV))


@settings(max_examples=25, deadline=None)
@given(
    num_terms=st.integers(2, 4),
    max_operand=st.integers(3, 30),
    ops=st.sets(st.sampled_from("+-*"), min_size=1).map("".join),
    sizes=st.tuples(st.integers(1, 20), st.integers(1, 10), st.integers(1, 10)),
    seed=st.integers(0, 10_000),
)
def test_arith_any_valid_options_give_correct_disjoint_splits(num_terms: int, max_operand: int, ops: str,
                                                              sizes: tuple[int, int, int], seed: int) -> None:
    space = (max_operand + 1) ** num_terms * len(ops) ** (num_terms - 1)
    assume(sum(sizes) <= space)  # beyond that the options are refused (tested below); dense requests enumerate
    opts = ArithOptions(num_terms=num_terms, max_operand=max_operand, ops=ops, num_train=sizes[0],
                        num_dev=sizes[1], num_hidden=sizes[2], seed=seed)
    data = ArithTask(opts).load()
    assert (len(data.train), len(data.dev), len(data.hidden)) == sizes
    assert not prompts(data, Split.HIDDEN) & (prompts(data, Split.TRAIN) | prompts(data, Split.DEV))
    for rec in data.train + data.dev + data.hidden:
        assert rec.text.endswith("=")
        expr = rec.text[:-1]
        assert set(expr) <= set("0123456789") | set(ops)
        assert rec.answer == str(python_value(expr))


# -- arith: the evaluator -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "value"),
    [("7", 7), ("2+3", 5), ("2-3", -1), ("2*3", 6), ("2+3*4", 14), ("2*3+4", 10), ("10-2*3", 4),
     ("2*3*4-5", 19), ("0-0*9", 0), ("1-2-3", -4), ("5-3*2+1", 0), ("12*0+99", 99)],
)
def test_evaluate_examples(expr: str, value: int) -> None:
    assert _evaluate(expr) == value


# A sum of products, built together with its value: terms joined by + or -, factors by *.
_product = st.lists(st.integers(0, 999), min_size=1, max_size=4)
_terms = st.lists(st.tuples(st.sampled_from("+-"), _product), min_size=0, max_size=4)


@settings(max_examples=200, deadline=None)
@given(first=_product, rest=_terms)
def test_evaluate_matches_integer_arithmetic(first: list[int], rest: list[tuple[str, list[int]]]) -> None:
    text = "*".join(map(str, first))
    expected = math.prod(first)
    for sign, factors in rest:
        text += sign + "*".join(map(str, factors))
        expected += (1 if sign == "+" else -1) * math.prod(factors)
    assert _evaluate(text) == expected
    assert python_value(text) == expected  # the reference walker agrees with the construction


# -- arith: options ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ops", ["+/", "/", "+-*^", "x"])
def test_arith_ops_outside_plus_minus_times_are_refused(ops: str) -> None:
    with pytest.raises(ValidationError) as info:
        ArithOptions(ops=ops)
    assert "task.options.ops" in str(info.value)


def test_arith_ops_error_through_the_plugin_names_the_path(plugins) -> None:
    with pytest.raises(ConfigError) as info:
        plugins.build("task_source", "arith", {"ops": "+/"}, "task.options")
    assert "task.options.ops" in info.value.message and "'/'" in info.value.message


def test_arith_too_many_problems_for_the_space() -> None:
    # 2 terms over 0..3 with '+': 16 expressions; all of them can be asked for, not one more.
    with pytest.raises(ValidationError) as info:
        ArithOptions(num_terms=2, max_operand=3, ops="+", num_train=13, num_dev=2, num_hidden=2)
    message = str(info.value)
    assert "can make 16 unique problems" in message and "17 were asked for" in message
    ok = ArithOptions(num_terms=2, max_operand=3, ops="+", num_train=12, num_dev=2, num_hidden=2)
    data = ArithTask(ok).load()
    assert sorted(r.text for r in data.train + data.dev + data.hidden) == sorted(
        f"{a}+{b}=" for a in range(4) for b in range(4))


def test_arith_quickstart_uses_every_problem_once() -> None:
    # the quickstart's task: all 30,000 `a op b` over 0..99 and + - *, split 28,500 / 500 / 1,000
    opts = ArithOptions(num_terms=2, max_operand=99, ops="+-*", num_train=28500, num_dev=500, num_hidden=1000)
    data = ArithTask(opts).load()
    texts = [r.text for r in data.train + data.dev + data.hidden]
    assert len(texts) == len(set(texts)) == 30000
    assert {c for t in texts for c in t if c in "+-*"} == {"+", "-", "*"}
    assert data == ArithTask(opts).load()


def _bound(text: str) -> int:
    return max(int(v) for v in text.rstrip("=").replace("-", "+").split("+"))


def test_arith_operand_mix_gives_each_bound_its_share_in_every_split() -> None:
    # [5, 30, 300]: all 72 problems up to 5, the rest split evenly over 6..30 and 31..300, shuffled into the splits
    opts = ArithOptions(num_terms=2, ops="+-", operand_mix=[300, 5, 30], num_train=700, num_dev=100, num_hidden=200)
    data = ArithTask(opts).load()
    texts = [r.text for r in data.train + data.dev + data.hidden]
    assert len(texts) == len(set(texts)) == 1000
    levels = [0 if b <= 5 else 1 if b <= 30 else 2 for b in map(_bound, texts)]
    # 464 drawn from 0..30 and 464 from 0..300 (a few of which land at 30 or below by chance)
    assert levels.count(0) == 72 and 464 <= levels.count(1) <= 474, [levels.count(i) for i in range(3)]
    assert max(map(_bound, texts)) <= 300
    for split in (data.train, data.dev, data.hidden):  # every split mixes easy and hard
        assert {0 if _bound(r.text) <= 5 else 1 if _bound(r.text) <= 30 else 2 for r in split} == {0, 1, 2}
    assert all(r.answer == str(_evaluate(r.text[:-1])) for r in data.hidden)
    assert data == ArithTask(opts).load() and data.version != ArithTask(
        opts.model_copy(update={"operand_mix": [5, 30, 301]})).load().version


def test_arith_operand_mix_unset_keeps_the_dataset_and_its_version() -> None:
    # the quickstart's data and warm-start cache key do not move because the option exists
    assert ArithTask(ArithOptions(**SMALL)).load().version == ArithTask(
        ArithOptions(**SMALL, operand_mix=None)).load().version
    assert ArithTask().load().version == "3bd792dc7f118ea5"  # measured before operand_mix existed


def test_arith_operand_mix_refuses_too_small_a_space_and_bad_bounds() -> None:
    with pytest.raises(ValidationError, match="raise the largest bound of task.options.operand_mix"):
        ArithOptions(num_terms=2, ops="+", operand_mix=[2, 3], num_train=13, num_dev=2, num_hidden=2)
    ArithOptions(num_terms=2, ops="+", operand_mix=[2, 3], num_train=12, num_dev=2, num_hidden=2)
    for bad in ([5, 5], [0, 9], [9]):
        with pytest.raises(ValidationError, match="operand_mix"):
            ArithOptions(operand_mix=bad, num_train=10, num_dev=2, num_hidden=2)


def test_arith_tool_demonstrations_call_the_calculator_on_exactly_their_share_of_train_rows() -> None:
    opts = ArithOptions(num_terms=2, max_operand=99, ops="*", num_train=200, num_dev=20, num_hidden=30,
                        tool_demo_fraction=0.2)
    data = ArithTask(opts).load()
    tool = [r for r in data.train if r.demonstration is not None]
    assert len(tool) == 40  # exactly round(0.2 * 200), seeded
    for r in tool:  # the policy's call, the environment's result, the policy's answer
        expr = r.text[:-1]
        assert r.demonstration == f"<calc>{expr}</calc><out>{r.answer}</out>{r.answer}"
        assert r.answer == str(_evaluate(expr)) and "*" in expr
    assert all(r.sft_target == r.answer for r in data.train if r.demonstration is None)  # the rest answer directly
    assert all(r.demonstration is None for r in data.dev + data.hidden)
    assert data == ArithTask(opts).load()
    # the same problems and splits as without tools: the demonstrations alone (and the version) differ
    plain = ArithTask(opts.model_copy(update={"tool_demo_fraction": 0.0})).load()
    assert [r.text for r in plain.train] == [r.text for r in data.train] and plain.version != data.version
    other = ArithTask(opts.model_copy(update={"tool_tag": "calculator"})).load()
    assert other.version != data.version and other.train[[r.id for r in data.train].index(tool[0].id)].demonstration \
        .startswith("<calculator>")


def test_arith_tool_demonstrations_keep_the_sloppy_teachers_final_answer() -> None:
    opts = ArithOptions(num_terms=2, max_operand=30, ops="-", num_train=300, num_dev=10, num_hidden=10,
                        tool_demo_fraction=0.5, teacher_sign_error=1.0)
    tool = [r for r in ArithTask(opts).load().train if r.demonstration.startswith("<calc>")]
    negative = [r for r in tool if r.answer.startswith("-")]
    assert len(tool) == 150 and negative
    # the tool's output is exact; the teacher drops the sign when it copies it into the answer
    assert all(r.demonstration.endswith(f"<out>{r.answer}</out>{r.answer[1:]}") for r in negative)


def test_arith_tool_tag_must_be_a_tool_name() -> None:
    with pytest.raises(ValidationError, match="tool_tag"):
        ArithOptions(tool_tag="calc>")
    with pytest.raises(ValidationError, match="tool_demo_fraction"):
        ArithOptions(tool_demo_fraction=1.5)


@pytest.mark.parametrize(
    "options", [{"num_terms": 1}, {"num_terms": 5}, {"max_operand": 0}, {"ops": ""}, {"num_train": 0},
                {"num_dev": 0}, {"num_hidden": 0}, {"numterms": 2}],
)
def test_arith_option_bounds(options: dict) -> None:
    with pytest.raises(ValidationError):
        ArithOptions(**options)


# -- jsonl --------------------------------------------------------------------------------------------


def rows(*items: dict) -> str:
    return "".join(json.dumps(item) + "\n" for item in items)


def jsonl_task(tmp_path: Path, train: str | bytes | None = None, dev: str | bytes | None = None,
               hidden: str | bytes | None = None, **options) -> JsonlTask:
    contents = {
        "train": rows({"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}) if train is None else train,
        "dev": rows({"prompt": "3+3=", "answer": "6"}) if dev is None else dev,
        "hidden": rows({"prompt": "4+4=", "answer": "8"}) if hidden is None else hidden,
    }
    paths = {}
    for split, text in contents.items():
        path = tmp_path / f"{split}.jsonl"
        path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
        paths[split] = str(path)
    return JsonlTask(JsonlOptions(**paths, **options))


def data_error(task: JsonlTask) -> str:
    with pytest.raises(DataError) as info:
        task.load()
    assert info.value.hint
    return info.value.message


def test_jsonl_valid_files_load(tmp_path: Path) -> None:
    task = jsonl_task(tmp_path)
    assert isinstance(task, TaskSource)
    data = task.load()
    assert data.name == "jsonl"
    assert [(r.text, r.answer, r.split) for r in data.train] == [("1+1=", "2", Split.TRAIN), ("2+2=", "4", Split.TRAIN)]
    assert [r.text for r in data.dev] == ["3+3="]
    assert [r.text for r in data.hidden] == ["4+4="]
    assert data == jsonl_task(tmp_path).load()  # deterministic, same version


def test_jsonl_blank_lines_crlf_extra_fields_and_numeric_answers(tmp_path: Path) -> None:
    train = '\n{"prompt": "a", "answer": 3, "meta": {"x": 1}}\r\n\n   \n{"prompt": "b", "answer": 0}\r\n'
    data = jsonl_task(tmp_path, train=train).load()
    assert [(r.text, r.answer) for r in data.train] == [("a", "3"), ("b", "0")]
    assert [r.id for r in data.train] == ["train-2", "train-5"]  # ids follow physical line numbers


def test_jsonl_custom_keys(tmp_path: Path) -> None:
    data = jsonl_task(
        tmp_path, train=rows({"q": "x?", "a": "1"}), dev=rows({"q": "y?", "a": "2"}), hidden=rows({"q": "z?", "a": "3"}),
        prompt_key="q", answer_key="a",
    ).load()
    assert [r.text for r in data.train + data.dev + data.hidden] == ["x?", "y?", "z?"]


def test_jsonl_version_follows_content(tmp_path: Path) -> None:
    before = jsonl_task(tmp_path).load().version
    changed = jsonl_task(tmp_path, train=rows({"prompt": "1+1=", "answer": "3"}, {"prompt": "2+2=", "answer": "4"}))
    assert changed.load().version != before
    assert jsonl_task(tmp_path).load().version == before


_GOOD = {"prompt": "ok", "answer": "1"}


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        (json.dumps({"prompt": "no answer"}), "no 'answer'"),
        (json.dumps({"prompt": "blank answer", "answer": "  "}), "no 'answer'"),
        (json.dumps({"prompt": "null answer", "answer": None}), "no 'answer'"),
        (json.dumps({"prompt": "", "answer": "1"}), "no non-empty 'prompt'"),
        (json.dumps({"prompt": "   ", "answer": "1"}), "no non-empty 'prompt'"),
        (json.dumps({"prompt": 5, "answer": "1"}), "no non-empty 'prompt'"),
        (json.dumps({"answer": "1"}), "no non-empty 'prompt'"),
        ('{"prompt": "x", "answer": ', "not valid JSON"),
        ("not json at all", "not valid JSON"),
        (json.dumps(["prompt", "answer"]), "expected a JSON object, got list"),
        ('"just a string"', "expected a JSON object, got str"),
        (json.dumps({"prompt": "x" * 11, "answer": "1"}), "11 chars, over max_prompt_chars=10"),
    ],
)
@pytest.mark.parametrize("split", ["train", "dev", "hidden"])
def test_jsonl_bad_row_names_file_and_line(tmp_path: Path, split: str, bad_line: str, expected: str) -> None:
    text = rows(_GOOD) + "\n" + bad_line + "\n" + rows(_GOOD)  # the bad row is on line 3
    task = jsonl_task(tmp_path, **{split: text}, max_prompt_chars=10)
    message = data_error(task)
    assert f"{tmp_path / f'{split}.jsonl'}:3:" in message
    assert expected in message


def test_jsonl_prompt_at_the_length_limit_is_fine(tmp_path: Path) -> None:
    data = jsonl_task(tmp_path, train=rows({"prompt": "x" * 10, "answer": "1"}), max_prompt_chars=10).load()
    assert data.train[0].text == "x" * 10


def test_jsonl_non_utf8_row_names_file_and_line(tmp_path: Path) -> None:
    text = rows(_GOOD).encode() + b'{"prompt": "caf\xe9", "answer": "1"}\n'
    message = data_error(jsonl_task(tmp_path, dev=text))
    assert f"{tmp_path / 'dev.jsonl'}:2:" in message and "UTF-8" in message


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_jsonl_empty_file(tmp_path: Path, text: str) -> None:
    message = data_error(jsonl_task(tmp_path, hidden=text))
    assert str(tmp_path / "hidden.jsonl") in message and "no rows" in message


def test_jsonl_missing_file(tmp_path: Path) -> None:
    task = jsonl_task(tmp_path)
    (tmp_path / "dev.jsonl").unlink()
    message = data_error(task)
    assert "dev" in message and "not found" in message and str(tmp_path / "dev.jsonl") in message


def test_jsonl_hidden_prompt_also_in_train_is_refused(tmp_path: Path) -> None:
    task = jsonl_task(tmp_path, hidden=rows({"prompt": "4+4=", "answer": "8"}, {"prompt": "2+2=", "answer": "4"}))
    message = data_error(task)
    assert "1 hidden prompt(s) also appear in train or dev" in message and "2+2=" in message


def test_jsonl_options_require_all_three_files(tmp_path: Path) -> None:
    with pytest.raises(ValidationError):
        JsonlOptions(train="a", dev="b")


def test_jsonl_options_through_the_plugin(plugins, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        plugins.build("task_source", "jsonl", {"train": "a", "dev": "b"}, "task.options")
    assert "task.options.hidden" in info.value.message
    task = jsonl_task(tmp_path)
    built = plugins.build("task_source", "jsonl", task.options.model_dump(), "task.options")
    assert built.load() == task.load()
