"""tests/gpu/prepare.py and summary.py, the parts of tests/gpu/run.sh that decide before any GPU time is spent:
which wheels from .whl/ go onto the GPU machine's python, the import check's message, the closing table; and
that scripts/gpu_wheels.sh's pins and run.sh's step budgets still hold (pyproject's ranges, 9 minutes)."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.gpu import summary
from tests.gpu.prepare import (OPTIONAL_STEP, REPO, PrepareError, check_imports, choose, plan, read_wheels,
                               rlctl_requirements)


def _wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    """A real (installable-shaped) wheel file holding only its METADATA."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{stem}-py3-none-any.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}")
    return path


def _image(**versions: str):
    have = {canonicalize_name(k): Version(v) for k, v in versions.items()}
    return lambda name: have.get(name)


def _reqs(*specs: str) -> list[Requirement]:
    return [Requirement(s) for s in specs]


def test_the_image_version_in_range_stays_and_one_outside_takes_the_wheel(tmp_path):
    _wheel(tmp_path, "rich", "15.0.0")
    _wheel(tmp_path, "typer", "0.29.2")
    got = plan(_reqs("typer>=0.27.2,<0.30", "rich>=13.9.4,<16"), read_wheels(tmp_path),
               _image(typer="0.27.2", rich="13.0.0"))
    assert set(got.wheels) == {"rich"} and not got.problems
    assert got.rows["typer"] == ("<0.30,>=0.27.2", "0.27.2", "image")
    assert got.rows["rich"][1:] == ("15.0.0", "rich-15.0.0-py3-none-any.whl")


def test_a_missing_package_brings_its_wheel_and_the_wheels_own_requirements(tmp_path):
    _wheel(tmp_path, "pydantic", "2.14.4", "pydantic-core==2.50.5", "typing-extensions>=4.16.0",
           'tomli; python_version < "3.0"', 'email-validator>=2; extra == "email"')
    _wheel(tmp_path, "pydantic-core", "2.50.5", "typing-extensions>=4.16.0")
    _wheel(tmp_path, "typing-extensions", "4.16.0")
    got = plan(_reqs("pydantic>=2.6,<3"), read_wheels(tmp_path), _image(typing_extensions="4.12.2"))
    assert set(got.wheels) == {"pydantic", "pydantic-core", "typing-extensions"} and not got.problems
    assert "tomli" not in got.rows and "email-validator" not in got.rows  # markers and extras left out


def test_a_requirement_nobody_meets_names_the_package_and_the_fix(tmp_path):
    _wheel(tmp_path, "alembic", "1.20.1", "sqlalchemy>=2.0", "mako")
    got = plan(_reqs("alembic>=1.13,<2"), read_wheels(tmp_path), _image(mako="1.4.3", sqlalchemy="1.4.54"))
    assert got.problems == ["sqlalchemy>=2.0 (needed by alembic): the image has 1.4.54, .whl/ has no wheel of it; "
                            "add 'sqlalchemy==VERSION' (a version in that range) to scripts/gpu_wheels.sh and run it"]
    assert got.rows["sqlalchemy"][2] == "image" and got.rows["mako"][2] == "image"


def test_a_wheel_taken_for_one_requirement_is_held_against_the_others(tmp_path):
    """rlctl's range on typing-extensions is met by the image, but a wheel taken later needs a newer one: the
    wheel of typing-extensions that comes in must still meet rlctl's range, and here it does not."""
    _wheel(tmp_path, "pydantic", "2.14.4", "typing-extensions>=4.16.0")
    _wheel(tmp_path, "typing-extensions", "4.16.0")
    got = plan(_reqs("typing-extensions>=4.12,<4.15", "pydantic>=2.6"), read_wheels(tmp_path),
               _image(typing_extensions="4.13.0"))
    assert len(got.problems) == 1 and got.problems[0].startswith("typing-extensions<4.15,>=4.12 (needed by rlctl)")
    assert "change its pin in scripts/gpu_wheels.sh" in got.problems[0]


def test_two_wheels_of_one_name_are_refused(tmp_path):
    _wheel(tmp_path, "rich", "13.9.4")
    _wheel(tmp_path, "rich", "15.0.0")
    with pytest.raises(PrepareError, match="two wheels of rich"):
        read_wheels(tmp_path)


def test_an_unmet_bench_requirement_leaves_trl_out_but_an_unmet_core_one_stops(tmp_path, capsys):
    _wheel(tmp_path, "trl", "1.16.0", "pyarrow>=21.0.0")
    _wheel(tmp_path, "pydantic", "2.14.4")
    wheels = read_wheels(tmp_path)
    chosen = choose(_reqs("pydantic>=2.6"), _reqs("trl==1.16.0"), wheels, _image())
    assert set(chosen.wheels) == {"pydantic"}
    assert "TRL left out (TRL step time will fail): pyarrow>=21.0.0 (needed by trl)" in capsys.readouterr().err
    with pytest.raises(PrepareError, match="sqlalchemy>=2.0 \\(needed by rlctl\\): the image lacks it"):
        choose(_reqs("sqlalchemy>=2.0"), [], wheels, _image())


def test_the_import_check_names_what_is_missing_and_the_step_that_needs_it(capsys):
    failures, warnings = check_imports((("json", "json", "every step"),
                                        ("rlctl_no_such_module", "rlctl-no-such", "gpu tests"),
                                        ("rlctl_no_such_bench_module", "x", OPTIONAL_STEP)))
    assert failures == ["rlctl_no_such_module: ModuleNotFoundError: No module named 'rlctl_no_such_module' "
                        "(missing: rlctl_no_such_module; needed by gpu tests)"]
    assert len(warnings) == 1 and "rlctl_no_such_bench_module" in warnings[0]
    assert re.search(r"^json\s+\?\s+image\s+every step$", capsys.readouterr().out, re.M)


def _pins(script: str) -> dict[str, Version]:
    body = (REPO / script).read_text()
    pins = re.findall(r"\b([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.]*)", body)
    names = [canonicalize_name(n) for n, _ in pins]
    assert len(names) == len(set(names)), f"{script} pins a name twice"
    return {canonicalize_name(n): Version(v) for n, v in pins}


def test_the_wheels_script_pins_versions_inside_pyprojects_ranges():
    core, bench = rlctl_requirements()
    pins = _pins("scripts/gpu_wheels.sh")
    checked = [r for r in core + bench if canonicalize_name(r.name) in pins]
    assert {canonicalize_name(r.name) for r in checked} >= {"pydantic", "sqlalchemy", "alembic", "trl", "typer"}
    for req in checked:
        assert req.specifier.contains(pins[canonicalize_name(req.name)]), f"{req} vs scripts/gpu_wheels.sh"


def test_run_sh_step_budgets_fit_in_nine_minutes():
    steps = re.search(r"^STEPS=\((.*)\)$", (REPO / "tests/gpu/run.sh").read_text(), re.M)[1].split()
    budgets = {s.split(":")[0]: int(s.split(":")[1]) for s in steps}
    assert list(budgets)[:3] == ["setup", "imports", "cuda"]  # nothing runs on the GPU before these pass
    assert sum(budgets.values()) + 5 * len(budgets) <= 600 and sum(budgets.values()) <= 540


def test_the_summary_table_reads_each_steps_numbers(tmp_path):
    (tmp_path / "setup.txt").write_text(
        "torch                 <=2.13.0,>=2.11           2.11.0      image\n"  # prepare.py's plan table
        "installed 11 wheels and rlctl (editable) into /tmp/rlctl-gpu/site\n"
        "torch                         2.11.0          image   every step\n"
        "trl                           1.16.0          site    TRL step time\n"
        "device: NVIDIA H200, torch 2.11.0+cu130, CUDA 13.0\n")
    (tmp_path / "pytest.txt").write_text("....s\nSKIPPED [1] tests/gpu/test_gpu.py:113: could not import 'ray'\n"
                                         "4 passed, 1 skipped in 61.20s (0:01:01)\n")
    (tmp_path / "quickstart.json").write_text(json.dumps(
        {"run": {"status": "completed"}, "wall_s": 41.3, "last_metrics": {"reward_mean": 0.5, "loss": -0.01}}))
    (tmp_path / "fsdp_ledger.txt").write_text(
        "step time: median 0.912 s over steps 2-5 (all: 3.1, 0.9, 0.91, 0.92); generated tokens/step 2048\n"
        "peak memory (torch.cuda.max_memory_allocated, largest phase): 7.41 GiB\n"
        "phase         role                              ledger    measured   ratio\n"
        "rollout       local engine (generate)         6.10 GiB    5.90 GiB    1.03\n"
        "train         learner (train_step)            7.50 GiB    7.41 GiB    1.01\n"
        "sync          weight sync                     2.00 GiB    1.90 GiB    1.05\n")
    (tmp_path / "trl_step_time.txt").write_text(
        "qwen2-0.5b: qwen2 h896 L24 heads 14/2, 494.0M params        1.234    2.468      2.00           2048/2048 \n")
    rows = ["setup 25 4 0", "imports 25 9 0", "cuda 15 2 0", "pytest 150 61 0", "quickstart 110 44 0",
            "fsdp_ledger 100 100 124", "trl_step_time 110 - -"]
    text = summary.table(tmp_path, rows)
    assert "11 wheels from .whl/" in text and "torch 2.11.0 (image), trl 1.16.0 (site)" in text
    assert "NVIDIA H200, torch 2.11.0+cu130, CUDA 13.0" in text and "4 passed, 1 skipped in 61.20s" in text
    assert "run completed, wall 41.3 s; last step: reward_mean 0.5, loss -0.01" in text
    assert re.search(r"^fsdp_ledger\s+100\s+100\s+timed out\s+step 0.912 s median; peak 7.41 GiB; "
                     r"ledger/measured rollout 1.03, train 1.01, sync 1.05$", text, re.M)
    assert "rlctl 1.234 s, TRL 2.468 s per step: TRL/rlctl 2.00x" not in text  # a step not run shows no numbers
    assert re.search(r"^trl_step_time\s+110\s+-\s+not run\s*$", text, re.M)
    assert re.search(r"^total\s+535\s+220$", text, re.M)
    (tmp_path / "setup.txt").write_text("no CUDA device: torch 2.11.0 sees none (torch.cuda.is_available() is "
                                        "False); tests/gpu/run.sh needs one CUDA GPU\n")
    assert re.search(r"^cuda\s+15\s+2\s+no CUDA device\s+torch 2.11.0 sees none \(torch.cuda.is_available\(\) "
                     r"is False\)$", summary.table(tmp_path, ["cuda 15 2 3"]), re.M)
    assert "TRL/rlctl 2.00x" in summary.table(tmp_path, ["trl_step_time 110 80 0"])
