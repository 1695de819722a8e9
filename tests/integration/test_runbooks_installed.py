"""Runbooks ship with the package: found from a wheel installed outside the source checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.integration.test_cli import REPO

pytestmark = pytest.mark.slow


def test_wheel_ships_runbooks_and_the_installed_package_finds_them(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheels"),
                    str(REPO)], check=True, capture_output=True, timeout=600)
    [wheel] = (tmp_path / "wheels").glob("rlctl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {Path(n).name for n in names if "/data/share/rlctl/runbooks/" in n}
    assert {p.name for p in (REPO / "runbooks").glob("*.md")} == shipped
    prefix = tmp_path / "prefix"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--prefix", str(prefix),
                    str(wheel)],  # --ignore-installed: never uninstall the environment's own rlctl
                   check=True, capture_output=True, timeout=600)
    [site] = prefix.glob("lib/python*/site-packages")
    code = ("import rlctl.incidents.runbooks as r; books = r.load_runbooks(); "
            "print(r.runbook_dirs()[0]); print(len(books)); print(r.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    where, count, module = out.stdout.split()
    assert module.startswith(str(prefix)), "imported the checkout instead of the installed wheel"
    assert Path(where) == prefix / "share" / "rlctl" / "runbooks"
    assert int(count) == len(list((REPO / "runbooks").glob("*.md"))) - 1  # README.md is not a runbook
