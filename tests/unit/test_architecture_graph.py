"""scripts/architecture_graph.py: the import graph read with ast, its cycles and floors, and the doc it writes.

The checks run on small packages written here (so each rule is pinned whatever rlctl's own graph is
today) and on docs/architecture.md, whose generated section must match the code.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "architecture_graph.py"


@pytest.fixture(scope="module")
def graph():
    spec = importlib.util.spec_from_file_location("architecture_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "rlctl"
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in [pkg, *[p for p in pkg.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()
    return pkg


LAYERS = (("rlctl", "low"), ("mid_a", "mid_b"), ("high",))  # "rlctl": the package's own __init__.py


def test_a_clean_package_has_no_problems(graph, tmp_path):
    root = _package(tmp_path, {"low/x.py": "", "mid_a/y.py": "from rlctl.low import x\n",
                               "high/z.py": "import rlctl.mid_a.y\nfrom rlctl.low.x import thing\n"})
    assert graph.problems(root, LAYERS) == []
    _, edges = graph.scan(root)
    assert {(e.source, e.target, e.kind) for e in edges} == {
        ("rlctl.mid_a.y", "rlctl.low.x", "top"), ("rlctl.high.z", "rlctl.mid_a.y", "top"),
        ("rlctl.high.z", "rlctl.low.x", "top")}


def test_upward_sideways_and_unknown_packages_are_named_with_file_and_line(graph, tmp_path):
    root = _package(tmp_path, {
        "low/x.py": "def f():\n    from rlctl.high import z\n",  # lazy, upward
        "mid_a/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlctl.mid_b import w\n",
        "mid_b/w.py": "", "high/z.py": "", "stray/s.py": ""})
    found = graph.problems(root, LAYERS)
    assert any(p.startswith("upward import: low -> high (lazy;") and "low/x.py:2" in p for p in found), found
    assert any(p.startswith("sideways (same floor) import: mid_a -> mid_b (typing;") for p in found), found
    assert any(p.startswith("package stray is not in LAYERS") for p in found), found


def test_module_and_package_cycles_through_relative_and_lazy_imports(graph, tmp_path):
    root = _package(tmp_path, {
        "low/a.py": "from . import b\n",
        "low/b.py": "def g():\n    from .a import name\n",
        "low/c.py": "def h():\n    from rlctl.mid_a.d import k\n",
        "mid_a/d.py": "from rlctl.low import c\n"})
    found = graph.problems(root, LAYERS)
    cycles = [p for p in found if p.startswith("module cycle:")]
    assert len(cycles) == 2, found
    assert any("rlctl.low.a -> rlctl.low.b (top" in p and "rlctl.low.b -> rlctl.low.a (lazy" in p for p in cycles)
    assert "package cycle among low, mid_a: low -> mid_a -> low" in found


def test_every_member_of_a_package_cycle_is_shown_on_a_walk(graph):
    arrows = {"a": {"b"}, "b": {"a", "c"}, "c": {"b"}}
    assert graph.cycles(arrows, [(x, y) for x, ys in arrows.items() for y in ys]) == [["a", "b", "c"]]
    walks = graph._cycle_walks(["a", "b", "c"], arrows)
    assert {node for walk in walks for node in walk} == {"a", "b", "c"}
    assert all(walk[0] == walk[-1] for walk in walks)


def test_the_generated_section_replaces_only_what_is_between_the_markers(graph):
    doc = f"intro\n{graph.BEGIN}\nold\n{graph.END}\noutro\n"
    assert graph.with_generated(doc, "new\n") == f"intro\n{graph.BEGIN}\nnew\n{graph.END}\noutro\n"


def test_docs_architecture_md_is_current():
    """The picture in docs/architecture.md is the code's: regenerate it when packages or arrows change."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--check-doc", str(REPO / "docs" / "architecture.md")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_plugin_imports_outside_the_public_surface_are_named(graph, tmp_path):
    root = _package(tmp_path, {"contracts/types.py": "", "engine/faults.py": ""})
    plugins = tmp_path / "plugins"
    for name, text in {"p_one/__init__.py": "", "p_one/plugin.py": (
            "from rlctl import hookimpl\nfrom rlctl.contracts.types import X\nfrom rlctl.engine import faults\n"
            "def f():\n    import p_two.learner\n"),
            "p_two/__init__.py": "", "p_two/learner.py": "from . import helper\n", "p_two/helper.py": ""}.items():
        (plugins / name).parent.mkdir(parents=True, exist_ok=True)
        (plugins / name).write_text(text)
    found = [line.split(": ", 1)[1] for line in graph.plugin_problems(plugins, root)]
    assert found == ["p_one imports rlctl.engine.faults (top)", "p_one imports p_two.learner (lazy)"]


def test_rlctl_has_no_import_cycle_and_no_upward_import(graph):
    """Imports inside rlctl/ point one way, down the floors of LAYERS (lazy imports inside functions count), and
    no two modules import each other, however indirectly."""
    assert graph.problems() == []


def test_every_package_of_rlctl_has_a_floor(graph):
    packages = {p.name for p in (REPO / "rlctl").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert {p for p in packages if graph.tier_of(p) is None} == set()
