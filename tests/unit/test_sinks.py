"""The JSONL metric sink never holds a step twice, also across a resume or a torn last line; a reader of the file
while it is written sees whole lines only."""

from __future__ import annotations

import json

from rlctl_sinks.jsonl import JsonlSink


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_rewrites_steps_from_the_resume_point(tmp_path):
    sink = JsonlSink(tmp_path)
    for step in range(5):
        sink.write(step, {"loss": float(step)})
    sink.close()
    resumed = JsonlSink(tmp_path)  # a resume from a checkpoint taken after step 2
    resumed.write(3, {"loss": 30.0})
    resumed.write(4, {"loss": 40.0})
    resumed.close()
    assert _steps(tmp_path / "metrics.jsonl") == [0, 1, 2, 3, 4]
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["metrics"]["loss"] == 40.0


def test_torn_last_line_is_cut_and_plain_append_keeps_history(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "metrics": {}}\n{"step": 1, "metr')
    sink = JsonlSink(tmp_path)
    sink.write(1, {"x": float("nan")})
    sink.write(2, {"x": 1.0})
    sink.close()
    assert _steps(path) == [0, 1, 2]
    assert json.loads(path.read_text().splitlines()[1])["metrics"]["x"] == "nan"


def test_a_reader_sees_whole_lines_only_while_a_line_is_written_or_after_a_crash(tmp_path):
    from rlctl.storage.step_lines import complete_lines

    path = tmp_path / "metrics.jsonl"
    assert complete_lines(path) == []  # not written yet
    path.write_text('{"step": 0, "metrics": {}}\n{"step": 1, "metr')  # step 1's line half written (or torn)
    assert [line["step"] for line in complete_lines(path)] == [0]
    path.write_text('{"step": 0, "metrics": {}}\n{"step": 1, "metrics": {}}\n')
    assert [line["step"] for line in complete_lines(path)] == [0, 1]
