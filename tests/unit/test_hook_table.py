"""scripts/hook_table.py: the hook and registration tables in docs/plugins.md are generated from the code."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "hook_table.py"


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("hook_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_hookspec_is_a_row(table):
    from rlctl.hooks import hookspecs

    specs = {name for name in dir(hookspecs) if hasattr(getattr(hookspecs, name), "rlctl_spec")}
    assert {row["name"] for row in table.hooks()} == specs
    assert all(row["doc"] for row in table.hooks())  # every spec says when it is called and what to do


def test_registrations_match_what_the_plugin_manager_loads(table, plugins):
    from rlctl.hooks.manager import KINDS

    generated = {(hook, name.strip("`")) for _, hook, names in table.registrations() for name in names}
    builtin = {info.name for info in plugins.infos() if info.builtin}
    loaded = {(KINDS[kind][0], name) for kind in KINDS for name in plugins.names(kind)
              if plugins.get(kind, name).plugin in builtin}
    assert generated == loaded


def test_docs_plugins_md_is_current():
    """Regenerate with `python scripts/hook_table.py --write docs/plugins.md` after changing a hook or plugin."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--check-doc", str(REPO / "docs" / "plugins.md")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
