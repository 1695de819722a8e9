"""Grader regression checks: replay a golden file of (prompt, response, expected reward) through the graders.

What this is: ``check_golden()``, behind ``rlctl reward check GOLDEN.jsonl``,
and ``update_golden()`` (``--update``), which rewrites a golden file's expected
values and grader versions from the graders as they are now.

The golden file is JSON lines. The first line is a header,
``{"golden": 1, "graders": {NAME: {"version": V, "options": {...}}}}``: each
grader's version and options when the file was made. Every other line is one
row: ``{"id", "component", "prompt", "response", "answer", "expected"}`` plus,
optionally, ``"error"`` (the expected error_code, e.g. "sandbox_error"),
``"terminal"`` (eos, length, stop, abort; default eos), ``"num_tokens"`` (the
response's token count; default its characters) and ``"max_tokens"``.
A row is replayed through the grader NAME built with the options of the
config's component NAME when a config names it, else the header's options.
Any difference in the score or the error code is a mismatch, reported with the
row's line number and id; a grader whose version differs from the header's is
named next to them (the likely cause).

What this is not: a benchmark of the policy (rlctl.lifecycle.evaluate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlctl.config.models import RunConfig
from rlctl.contracts.errors import DataError
from rlctl.contracts.types import SamplingConfig, TerminalReason, Trajectory
from rlctl.hooks.manager import Plugins

GOLDEN_FORMAT = 1
TOLERANCE = 1e-9


@dataclass(frozen=True)
class Mismatch:
    line: int
    id: str
    component: str
    expected: float
    got: float
    expected_error: str | None
    got_error: str | None

    def describe(self) -> str:
        want = self.expected_error or f"{self.expected:g}"
        have = self.got_error or f"{self.got:g}"
        return f"line {self.line} (id {self.id}, {self.component}): expected {want}, got {have}"


@dataclass
class CheckResult:
    rows: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    versions: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (in the file, now)
    changed: dict[str, tuple[str, str]] = field(default_factory=dict)  # the names whose version differs


def read_golden(path: Path) -> tuple[dict[str, Any], list[tuple[int, dict[str, Any]]]]:
    """(header, [(line number, row)]) of a golden file; DataError naming the line on a malformed one."""
    if not path.is_file():
        raise DataError(f"golden file not found: {path}", "pass a JSONL file, e.g. tests/fixtures/golden_rewards.jsonl")
    header, rows = None, []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number} is not JSON ({err.msg})", "one JSON object per line") from None
        if header is None:
            if item.get("golden") != GOLDEN_FORMAT or not isinstance(item.get("graders"), dict):
                raise DataError(f"{path}:{number} is not a golden header",
                                f'start the file with {{"golden": {GOLDEN_FORMAT}, "graders": {{...}}}}')
            header = item
            continue
        missing = [k for k in ("id", "component", "response", "answer", "expected") if k not in item]
        if missing:
            raise DataError(f"{path}:{number} lacks {', '.join(missing)}", "see docs/evaluation.md for the row format")
        rows.append((number, item))
    if header is None:
        raise DataError(f"{path} is empty", "write a header line and at least one row")
    return header, rows


def trajectory_for(row: Mapping[str, Any]) -> Trajectory:
    """A scored-to-be trajectory carrying the row's response (token ids are placeholders: graders read text,
    the count and the ending)."""
    count = int(row.get("num_tokens", len(row["response"])))
    sampling = SamplingConfig(temperature=0.0, max_tokens=int(row.get("max_tokens", max(count, 1))))
    return Trajectory.create(id=f"{row['id']}/0", prompt_id=str(row["id"]), group_index=0, dataset_version="golden",
                             policy_version=0, tokenizer_hash="golden", prompt_tokens=(), response_tokens=(0,) * count,
                             response_text=row["response"], action_mask=(1,) * count,
                             behavior_logprobs=(0.0,) * count, sampling_config=sampling,
                             terminal_reason=TerminalReason(row.get("terminal", "eos")), rollout_started_at=0.0)


def build_graders(header: Mapping[str, Any], names: Sequence[str], plugins: Plugins,
                  config: RunConfig | None) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Each named grader and its options: the config's for it if the config has it, else the header's."""
    from rlctl.placement.build import reward_options

    configured = {c.name: c.options for c in config.reward.components} if config is not None else {}
    base = config if config is not None else RunConfig()
    graders = {}
    for name in names:
        options = configured.get(name, header["graders"].get(name, {}).get("options", {}))
        graders[name] = (plugins.build("reward_function", name, reward_options(base, plugins, name, options),
                                       f"golden grader {name}"), dict(options))
    return graders


def _selected(header: Mapping[str, Any], rows: Sequence[tuple[int, dict]], components: Sequence[str] | None
              ) -> tuple[list[str], list[tuple[int, dict]]]:
    names = sorted({row["component"] for _, row in rows})
    if components:
        unknown = sorted(set(components) - set(names))
        if unknown:
            raise DataError(f"the golden file has no rows for {', '.join(unknown)} (it has {', '.join(names)})",
                            "name components the file covers in --components")
        names = [n for n in names if n in components]
    return names, [(line, row) for line, row in rows if row["component"] in names]


def check_golden(path: Path, plugins: Plugins, config: RunConfig | None = None,
                 components: Sequence[str] | None = None) -> CheckResult:
    """Replay every selected row; the result lists mismatches and grader versions (file vs now)."""
    header, rows = read_golden(path)
    names, rows = _selected(header, rows, components)
    graders = build_graders(header, names, plugins, config)
    result = CheckResult(rows=len(rows))
    for line, row in rows:
        grader = graders[row["component"]][0]
        got = grader.score(trajectory_for(row), row["answer"])
        now = getattr(grader, "version", None) or got.grader_version
        result.versions.setdefault(row["component"], (header["graders"].get(row["component"], {}).get("version", "?"),
                                                      now))
        want_error = row.get("error")
        if got.error_code != want_error or (want_error is None and abs(got.total - float(row["expected"])) > TOLERANCE):
            result.mismatches.append(Mismatch(line, str(row["id"]), row["component"], float(row["expected"]),
                                              got.total, want_error, got.error_code))
    result.changed = {n: v for n, v in result.versions.items() if v[0] != v[1]}
    return result


def update_golden(path: Path, plugins: Plugins, config: RunConfig | None = None) -> int:
    """Rewrite ``path``'s expected values, error codes and grader versions from the graders as they are now."""
    header, rows = read_golden(path)
    names = sorted({row["component"] for _, row in rows})
    graders = build_graders(header, names, plugins, config)
    lines = []
    for _, row in rows:
        grader, options = graders[row["component"]]
        got = grader.score(trajectory_for(row), row["answer"])
        row = {**row, "expected": got.total}
        row.pop("error", None)
        if got.error_code is not None:
            row["error"] = got.error_code
        lines.append(json.dumps(row, ensure_ascii=False))
        entry = header["graders"].setdefault(row["component"], {})
        entry["version"] = getattr(grader, "version", None) or got.grader_version
        entry["options"] = options
    path.write_text("\n".join([json.dumps(header, sort_keys=True), *lines]) + "\n", encoding="utf-8")
    return len(lines)
