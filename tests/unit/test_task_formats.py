"""Chat-format prompts, Parquet sources, answer extraction, and what the dataset version covers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rlctl.contracts.errors import DataError
from rlctl_tasks.jsonl import JsonlOptions, JsonlTask

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def chat_files(tmp_path: Path) -> dict[str, str]:
    def chat(q: str, a: str) -> dict:
        return {"messages": [{"role": "system", "content": "Answer with a number."},
                             {"role": "user", "content": q}], "answer": a}

    return {"train": write_jsonl(tmp_path / "train.jsonl", [chat("1+1=", "2"), chat("2+2=", "4")]),
            "dev": write_jsonl(tmp_path / "dev.jsonl", [chat("3+3=", "6")]),
            "hidden": write_jsonl(tmp_path / "hidden.jsonl", [chat("4+4=", "8")])}


def save_tokenizer(path: Path, template: str | None = TEMPLATE, extra_token: str | None = None) -> str:
    from rlctl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    if template is not None:
        tok.chat_template = template
    if extra_token:
        tok.add_tokens([extra_token])
    tok.save_pretrained(path)
    return str(path)


def test_chat_rows_are_rendered_with_the_tokenizers_template(tmp_path):
    tok = save_tokenizer(tmp_path / "tok")
    data = JsonlTask(JsonlOptions(**chat_files(tmp_path), messages_key="messages", tokenizer=tok)).load()
    assert data.train[0].text == "<system>Answer with a number.\n<user>1+1=\n<assistant>"
    assert data.train[0].answer == "2"
    # the built-in character tokenizer has no template of its own: an explicit one renders the same text
    builtin = JsonlTask(JsonlOptions(**chat_files(tmp_path), messages_key="messages", chat_template=TEMPLATE)).load()
    assert [r.text for r in builtin.train] == [r.text for r in data.train]


def test_a_tokenizer_without_a_chat_template_is_a_clear_error(tmp_path):
    with pytest.raises(DataError) as err:
        JsonlTask(JsonlOptions(**chat_files(tmp_path), messages_key="messages")).load()
    assert "built-in character tokenizer has no chat template" in err.value.message
    assert "chat_template" in err.value.hint
    tok = save_tokenizer(tmp_path / "plain", template=None)
    with pytest.raises(DataError, match="has no chat template"):
        JsonlTask(JsonlOptions(**chat_files(tmp_path), messages_key="messages", tokenizer=tok)).load()


@pytest.mark.parametrize("messages, problem", [
    ("just text", "must be a non-empty list"),
    ([], "must be a non-empty list"),
    ([{"role": "user"}], "must be a non-empty list"),
    (None, "must be a non-empty list"),
])
def test_bad_chat_rows_name_file_and_line(tmp_path, messages, problem):
    files = chat_files(tmp_path)
    with open(files["dev"], "a") as fh:
        fh.write(json.dumps({"messages": messages, "answer": "1"}) + "\n")
    with pytest.raises(DataError) as err:
        JsonlTask(JsonlOptions(**files, messages_key="messages", chat_template=TEMPLATE)).load()
    assert f"{files['dev']}:2" in err.value.message and problem in err.value.message


def test_a_template_that_fails_on_a_row_names_the_row(tmp_path):
    files = chat_files(tmp_path)
    bad = "{{ raise_exception('only user turns') if messages[0]['role'] != 'user' }}"
    with pytest.raises(DataError, match=r"train.jsonl:1: the chat template failed"):
        JsonlTask(JsonlOptions(**files, messages_key="messages", chat_template=bad)).load()


def test_answer_pattern_extracts_gsm8k_answers_and_names_rows_it_misses(tmp_path):
    sol = "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72"
    files = {"train": write_jsonl(tmp_path / "train.jsonl", [{"question": "How many clips?", "answer": sol},
                                                              {"question": "Big?", "answer": "x\n#### 1,234"}]),
             "dev": write_jsonl(tmp_path / "dev.jsonl", [{"question": "q2", "answer": "#### -3"}]),
             "hidden": write_jsonl(tmp_path / "hidden.jsonl", [{"question": "q3", "answer": "#### 5"}])}
    opts = dict(prompt_key="question", answer_pattern=r"####\s*(-?[\d,.]+)")
    data = JsonlTask(JsonlOptions(**files, **opts)).load()
    assert [r.answer for r in data.train] == ["72", "1,234"] and data.dev[0].answer == "-3"
    write_jsonl(tmp_path / "hidden.jsonl", [{"question": "q3", "answer": "#### 5"}, {"question": "q4", "answer": "5"}])
    with pytest.raises(DataError, match=r"hidden.jsonl:2: answer_pattern .* does not match"):
        JsonlTask(JsonlOptions(**files, **opts)).load()


def test_an_invalid_answer_pattern_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="answer_pattern is not a valid regex"):
        JsonlOptions(**chat_files(tmp_path), answer_pattern="(unclosed")


def test_new_unset_options_keep_existing_jsonl_versions(tmp_path):
    """Adding options must not silently re-version datasets users already trained on."""
    from rlctl_tasks.arith import dataset_version

    files = {"train": write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1=", "answer": "2"}]),
             "dev": write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2+2=", "answer": "4"}]),
             "hidden": write_jsonl(tmp_path / "h.jsonl", [{"prompt": "3+3=", "answer": "6"}])}
    data = JsonlTask(JsonlOptions(**files)).load()
    old_options = {**files, "prompt_key": "prompt", "answer_key": "answer", "max_prompt_chars": 4096}
    from rlctl import Split

    assert data.version == dataset_version("jsonl", old_options, {s: data.split(s) for s in Split})


# -- the dataset version covers template, tokenizer and grader; resume refuses a change ---------------------


def run_config(tmp_path: Path, tok: str, *extra: str):
    from rlctl.config.load import load_config

    files = chat_files(tmp_path)
    return load_config(None, ["task.source=jsonl", f"model.path={tok}",
                              "task.options={" + ", ".join(f"{k}: {v}" for k, v in files.items())
                              + ", messages_key: messages}", *extra])


def test_template_tokenizer_and_grader_changes_change_the_version_and_resume_refuses(tmp_path, plugins):
    from rlctl.placement.build import load_task
    from rlctl.engine.snapshot import compatibility_problems
    from tests.unit.test_checkpoint import make_state

    tok = tmp_path / "tok"
    save_tokenizer(tok)
    config = run_config(tmp_path, str(tok))
    base = load_task(config, plugins)  # the policy's tokenizer (model.path) renders the chat rows
    assert base.train[0].text.endswith("<user>1+1=\n<assistant>")
    assert load_task(config, plugins).version == base.version

    save_tokenizer(tok, template=TEMPLATE.replace("<assistant>", "<bot>"))
    templated = load_task(config, plugins)
    save_tokenizer(tok, extra_token="<tool>")  # same template, another tokenizer
    retokenized = load_task(config, plugins)
    save_tokenizer(tok)
    regraded = load_task(run_config(tmp_path, str(tok), "reward.components=[{name: math, weight: 1.0}]"), plugins)
    assert load_task(config, plugins).version == base.version
    versions = [base.version, templated.version, retokenized.version, regraded.version]
    assert len(set(versions)) == 4, versions
    assert [r.text for r in retokenized.train] == [r.text for r in base.train]  # same text, still a new version

    # resume compares the checkpoint's dataset version with the reloaded task's (rlctl.lifecycle.resume.resume)
    state = dataclasses.replace(make_state(1, tok), dataset_version=base.version)
    assert compatibility_problems(state, dataset_version=base.version) == []
    for changed in versions[1:]:
        problems = compatibility_problems(state, dataset_version=changed)
        assert len(problems) == 1 and "the dataset changed since checkpoint step 1" in problems[0]


# -- Parquet ---------------------------------------------------------------------------------------------------


def write_parquet(path: Path, columns: dict) -> str:
    pa = pytest.importorskip("pyarrow", reason="needs pyarrow: pip install -e '.[data]'")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table(columns), path)
    return str(path)


def gsm8k_files(tmp_path: Path) -> dict[str, str]:
    return {"train": write_parquet(tmp_path / "train.parquet", {"question": ["q1", "q2"],
                                                                 "answer": ["a\n#### 72", "b\n#### 10"]}),
            "dev": write_parquet(tmp_path / "dev.parquet", {"question": ["q3"], "answer": ["#### 3"]}),
            "hidden": write_parquet(tmp_path / "hidden.parquet", {"question": ["q4"], "answer": ["#### 4"]})}


def test_parquet_source_maps_columns_and_extracts_answers(tmp_path, plugins):
    from rlctl.config.load import load_config
    from rlctl.placement.build import load_task

    files = gsm8k_files(tmp_path)
    opts = "{" + ", ".join(f"{k}: {v}" for k, v in files.items()) + r", prompt_key: question, answer_pattern: '####\s*(\d+)'}"
    data = load_task(load_config(None, ["task.source=parquet", "task.options=" + opts]), plugins)
    assert [(r.text, r.answer) for r in data.train] == [("q1", "72"), ("q2", "10")]
    assert data.name == "parquet" and data.hidden[0].answer == "4"


def test_parquet_chat_column_renders_with_the_template(tmp_path):
    from rlctl_tasks.parquet import ParquetOptions, ParquetTask

    msgs = lambda q: [{"role": "user", "content": q}]  # noqa: E731
    files = {split: write_parquet(tmp_path / f"{split}.parquet", {"messages": [msgs(q)], "answer": [a]})
             for split, q, a in (("train", "1+1=", "2"), ("dev", "2+2=", "4"), ("hidden", "3+3=", "6"))}
    data = ParquetTask(ParquetOptions(**files, messages_key="messages", chat_template=TEMPLATE)).load()
    assert data.train[0].text == "<user>1+1=\n<assistant>"


def test_parquet_bad_rows_missing_columns_and_bad_files_are_named(tmp_path):
    from rlctl_tasks.parquet import ParquetOptions, ParquetTask

    files = gsm8k_files(tmp_path)
    write_parquet(tmp_path / "train.parquet", {"question": ["q1", None, "q2"], "answer": ["#### 1", "#### 2", "#### 3"]})
    with pytest.raises(DataError, match=r"train.parquet row 2: row has no non-empty 'question'"):
        ParquetTask(ParquetOptions(**files, prompt_key="question")).load()
    with pytest.raises(DataError, match=r"train.parquet: no column\(s\) 'prompt'"):
        ParquetTask(ParquetOptions(**files)).load()
    files = gsm8k_files(tmp_path)
    Path(files["dev"]).write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"dev.parquet: not a readable Parquet file"):
        ParquetTask(ParquetOptions(**files, prompt_key="question")).load()


# -- length-aware batching -------------------------------------------------------------------------------------


def varied_records(n: int) -> list:
    import random

    from rlctl import PromptRecord, Split

    rng = random.Random(5)
    return [PromptRecord(id=f"r{i}", text="x" * rng.randint(1, 200), answer="1", split=Split.TRAIN)
            for i in range(n)]


def test_length_grouping_batches_similar_lengths_and_keeps_every_prompt_once_per_epoch():
    from rlctl.engine.batching import PromptCursor

    recs = varied_records(96)
    spread = {}
    for window in (0, 6):
        cursor = PromptCursor(recs, seed=1, batch_size=8, length_window=window)
        epoch = [cursor.next(8) for _ in range(12)]
        assert sorted(r.id for batch in epoch for r in batch) == sorted(r.id for r in recs)
        lens = [[len(r.text) for r in batch] for batch in epoch]
        spread[window] = sum(max(x) - min(x) for x in lens) / len(lens)
        if window:
            assert [min(x) for x in lens] != sorted(min(x) for x in lens)  # batch order is shuffled, not short-to-long
    assert spread[6] < spread[0] / 3, spread


def test_length_grouped_cursor_resumes_exactly():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from rlctl.engine.batching import CursorState, PromptCursor

    recs = varied_records(40)

    @settings(max_examples=25, deadline=None)
    @given(st.integers(0, 7), st.integers(0, 60), st.integers(1, 30))
    def check(seed, cut, rest):
        straight = PromptCursor(recs, seed, batch_size=4, length_window=3).next(cut + rest)
        first = PromptCursor(recs, seed, batch_size=4, length_window=3)
        head = first.next(cut) if cut else []
        resumed = PromptCursor(recs, seed, CursorState(first.state.epoch, first.state.position),
                               batch_size=4, length_window=3)
        assert head + resumed.next(rest) == straight

    check()


def test_length_grouping_is_a_validated_config_option():
    from rlctl.config.load import load_config
    from rlctl.contracts.errors import ConfigError

    assert load_config(None, ["task.length_grouping=4"]).task.length_grouping == 4
    with pytest.raises(ConfigError, match="length_grouping"):
        load_config(None, ["task.length_grouping=-1"])


# -- a local Hugging Face datasets directory (save_to_disk) -----------------------------------------------------


def save_gsm8k_like(tmp_path: Path, **extra_columns) -> str:
    """A DatasetDict with only train and test splits, GSM8K's columns (question, answer '... #### N')."""
    datasets = pytest.importorskip("datasets", reason="needs datasets: pip install -e '.[data]'")
    train = {"question": [f"q{i}" for i in range(6)], "answer": [f"work\n#### {i}" for i in range(6)]}
    test = {"question": ["t1", "t2"], "answer": ["#### 10", "#### 1,234"]}
    for name, values in extra_columns.items():
        train[name], test[name] = values[:6], values[6:]
    path = tmp_path / "gsm8k"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(train),
                          "test": datasets.Dataset.from_dict(test)}).save_to_disk(str(path))
    return str(path)


def test_hf_disk_source_maps_columns_slices_splits_and_extracts_answers(tmp_path, plugins):
    from rlctl.config.load import load_config
    from rlctl.placement.build import load_task

    path = save_gsm8k_like(tmp_path)
    opts = (f"{{path: {path}, train: 'train[:-2]', dev: 'train[-2:]', hidden: test, prompt_key: question, "
            r"answer_pattern: '####\s*(-?[\d,]+)'}")
    data = load_task(load_config(None, ["task.source=hf_disk", "task.options=" + opts]), plugins)
    assert [(r.text, r.answer) for r in data.train] == [(f"q{i}", str(i)) for i in range(4)]
    assert [r.text for r in data.dev] == ["q4", "q5"] and [r.answer for r in data.hidden] == ["10", "1,234"]
    assert data.name == "hf_disk"


def test_hf_disk_chat_column_renders_with_the_template_and_single_dataset_dirs_work(tmp_path):
    datasets = pytest.importorskip("datasets", reason="needs datasets: pip install -e '.[data]'")
    from rlctl_tasks.hf_disk import HfDiskOptions, HfDiskTask

    dirs = {}
    for split, q, a in (("train", "1+1=", "2"), ("dev", "2+2=", "4"), ("hidden", "3+3=", "6")):
        dirs[split] = str(tmp_path / split)
        datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": q}]], "answer": [a]}).save_to_disk(
            dirs[split])
    data = HfDiskTask(HfDiskOptions(**dirs, messages_key="messages", chat_template=TEMPLATE)).load()
    assert data.train[0].text == "<user>1+1=\n<assistant>" and data.hidden[0].answer == "6"


def test_hf_disk_errors_name_the_directory_split_column_or_row(tmp_path):
    pytest.importorskip("datasets", reason="needs datasets: pip install -e '.[data]'")
    from rlctl_tasks.hf_disk import HfDiskOptions, HfDiskTask

    path = save_gsm8k_like(tmp_path)
    sliced = dict(train="train[:-2]", dev="train[-2:]", hidden="test")
    cases = [
        (dict(path=str(tmp_path / "missing")), "datasets directory not found"),
        (dict(path=str(tmp_path)), "is not a directory written by save_to_disk"),
        (dict(path=path, prompt_key="question"), r"has no split 'validation' \(it has: train, test\)"),
        (dict(path=path, **sliced),
         r"split train\[:-2\]: no column\(s\) 'prompt' \(it has \['question', 'answer'\]\)"),
        (dict(path=path, **sliced, prompt_key="question", answer_pattern=r"####\s*(\d+)$"),
         r"test row 2: answer_pattern .* does not match"),
        (dict(train=path, dev=path, hidden=path), "holds a DatasetDict"),
        (dict(path=path, **sliced, prompt_key="question", answer_key="solution"), "no column"),
    ]
    for options, problem in cases:
        with pytest.raises(DataError, match=problem) as err:
            HfDiskTask(HfDiskOptions(**options)).load()
        assert err.value.hint
    (Path(path) / "train" / "state.json").write_text("{broken")
    with pytest.raises(DataError, match="cannot load the saved dataset|not a directory written"):
        HfDiskTask(HfDiskOptions(path=path, **sliced, prompt_key="question")).load()


def test_hf_disk_bad_split_syntax_is_a_config_error(plugins):
    from rlctl.contracts.errors import ConfigError

    with pytest.raises(ConfigError, match="split name"):
        plugins.build("task_source", "hf_disk", {"path": "x", "train": "train[a:b]"}, "task.options")
