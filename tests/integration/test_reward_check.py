"""``rlctl reward check``: the shipped golden file replays clean; a changed grader fails it, naming the row."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rlctl.cli.app import main

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "fixtures" / "golden_rewards.jsonl"


def test_golden_file_replays_clean_without_the_sandbox(capsys):
    assert main(["reward", "check", str(GOLDEN), "--components", "math,digit_credit,format,length"]) == 0
    assert "rows match" in capsys.readouterr().out


def test_golden_file_code_rows_replay_clean(needs_sandbox, capsys):
    assert main(["reward", "check", str(GOLDEN), "--components", "code", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] >= 9 and out["mismatches"] == []


def test_a_changed_grader_fails_naming_the_row_and_its_version(monkeypatch, capsys):
    import rlctl_rewards.math as math_reward

    original = math_reward.MathReward.score

    def stricter(self, trajectory, reference):  # a "fix" that stops accepting 1/2 for 0.5
        result = original(self, trajectory, reference)
        if trajectory.response_text == "1/2":
            return dataclasses.replace(result, total=0.0, components={"math": 0.0})
        return result

    monkeypatch.setattr(math_reward, "VERSION", "1.1")
    monkeypatch.setattr(math_reward.MathReward, "score", stricter)
    assert main(["reward", "check", str(GOLDEN), "--components", "math"]) == 1
    err = capsys.readouterr().err
    line = next(i for i, text in enumerate(GOLDEN.read_text().splitlines(), 1) if "math-fraction-vs-decimal" in text)
    assert f"line {line} (id math-fraction-vs-decimal, math): expected 1, got 0" in err
    assert "grader math changed version since the golden file was made: math@1.0" in err and "math@1.1" in err
    assert "Traceback" not in err and "--update" in err


def test_update_rewrites_and_bad_files_are_named(tmp_path, capsys):
    golden = tmp_path / "g.jsonl"
    lines = GOLDEN.read_text().splitlines()
    row = json.loads(next(text for text in lines if '"format-words"' in text))
    golden.write_text("\n".join([lines[0], json.dumps({**row, "expected": 1.0})]) + "\n")
    assert main(["reward", "check", str(golden)]) == 1
    assert "line 2 (id format-words, format): expected 1, got 0" in capsys.readouterr().err
    assert main(["reward", "check", str(golden), "--update"]) == 0
    assert main(["reward", "check", str(golden)]) == 0
    assert json.loads(golden.read_text().splitlines()[1])["expected"] == 0.0
    golden.write_text('{"golden": 1, "graders": {}}\nnot json\n')
    assert main(["reward", "check", str(golden)]) != 0
    assert f"{golden}:2 is not JSON" in capsys.readouterr().err
    assert main(["reward", "check", str(golden), "--components", "nope"]) != 0
