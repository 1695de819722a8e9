"""Plugins import only the published surface, and the arrows between plugins and core point one way.

A plugin (every package under plugins/, and the third-party test plugin under
tests/fixtures/plugin_pkg) may import ``rlctl`` (hookimpl, contract types,
errors), ``rlctl.contracts`` and ``rlctl.kit`` with their submodules (the pure
tensor maths as ``rlctl.kit.algo``), plus its own package, the standard library
and third-party libraries. Never another module of rlctl, never another plugin's package.
Core (rlctl/) never imports a plugin, and nothing in core but the kit itself
imports the kit. Imports are read with ast, so lazy imports inside functions,
``TYPE_CHECKING`` blocks and ``importlib.import_module("...")`` with a literal
name count too.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN_ROOTS = (REPO / "plugins", REPO / "tests" / "fixtures" / "plugin_pkg")
# module -> whether its submodules are allowed too
ALLOWED = {"rlctl": False, "rlctl.contracts": True, "rlctl.kit": True}
# modules and packages (namespace packages too: rlctl/engine has no __init__.py) that ``from rlctl import x`` names
RLCTL_SUBPACKAGES = {p.stem for p in (REPO / "rlctl").iterdir()
                     if (p.suffix == ".py" or p.is_dir()) and not p.name.startswith("__")}


def plugin_packages() -> dict[str, Path]:
    """Every plugin package in the repository, by import name."""
    return {d.name: d for root in PLUGIN_ROOTS for d in sorted(root.iterdir()) if (d / "__init__.py").is_file()}


def imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every absolute import in ``tree`` (``from rlctl import engine`` names rlctl.engine)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            if node.module == "rlctl":
                for alias in node.names:
                    if alias.name in RLCTL_SUBPACKAGES:
                        yield node.lineno, f"rlctl.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def allowed_rlctl(module: str) -> bool:
    return any(module == base or (subs and module.startswith(base + ".")) for base, subs in ALLOWED.items())


def plugin_violations(path: Path, source: str, own: str, plugins: set[str]) -> list[str]:
    """``file:line: what`` for each import a plugin file of package ``own`` must not make."""
    out = []
    for line, module in imported_modules(ast.parse(source, filename=str(path))):
        top = module.split(".")[0]
        if top == "rlctl" and not allowed_rlctl(module):
            out.append(f"{path}:{line}: imports {module} (a plugin imports rlctl, rlctl.contracts or rlctl.kit; "
                       "if it needs a helper, export it from rlctl.kit)")
        elif top in plugins and top != own:
            out.append(f"{path}:{line}: imports {module}, another plugin's package (shared code belongs in rlctl.kit)")
    return out


def _rel(path: Path) -> Path:
    return path.relative_to(REPO)


def test_plugins_import_only_the_published_surface():
    packages = plugin_packages()
    assert {"rlctl_torch_learner", "rlctl_fsdp_learner", "rlctl_example_reward"} <= set(packages)
    problems = []
    scanned = 0
    for own, directory in packages.items():
        for path in sorted(directory.rglob("*.py")):
            problems += plugin_violations(_rel(path), path.read_text(), own, set(packages))
            scanned += 1
    assert scanned > 40
    assert not problems, "\n".join(problems)


def test_core_never_imports_a_plugin_nor_the_kit():
    plugins = set(plugin_packages())
    kit = REPO / "rlctl" / "kit"
    problems = []
    for path in sorted((REPO / "rlctl").rglob("*.py")):
        for line, module in imported_modules(ast.parse(path.read_text(), filename=str(path))):
            top = module.split(".")[0]
            if top in plugins:
                problems.append(f"{_rel(path)}:{line}: core imports the plugin module {module}")
            elif (module == "rlctl.kit" or module.startswith("rlctl.kit.")) and kit not in path.parents:
                problems.append(f"{_rel(path)}:{line}: core imports {module}; the kit sits above core, for plugins")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("source", "found"), [
    ("from rlctl.engine.faults import fault_site\n", "x.py:1: imports rlctl.engine.faults"),
    ("import os\n\ndef f():\n    import rlctl.planning.memory\n", "x.py:4: imports rlctl.planning.memory"),
    ("from rlctl import engine\n", "x.py:1: imports rlctl.engine"),
    ("from rlctl.algo.losses import value_loss\n", "x.py:1: imports rlctl.algo.losses"),
    ("import rlctl.algo as F\n", "x.py:1: imports rlctl.algo"),
    ("import importlib\nm = importlib.import_module('rlctl.serve.client')\n", "x.py:2: imports rlctl.serve.client"),
    ("from rlctl_fsdp_learner.learner import RankGroup\n", "x.py:1: imports rlctl_fsdp_learner.learner, another"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlctl.dist import ranks\n",
     "x.py:3: imports rlctl.dist"),
])
def test_the_scan_names_file_and_line_of_each_forbidden_import(source, found):
    problems = plugin_violations(Path("x.py"), source, "rlctl_mine", {"rlctl_mine", "rlctl_fsdp_learner"})
    assert len(problems) == 1 and problems[0].startswith(found), problems


def test_the_scan_lets_the_published_surface_and_own_package_through():
    source = ("from rlctl import RewardResult, hookimpl, kit\nfrom rlctl.contracts.types import LearnerContext\n"
              "from rlctl.kit import TorchLearner\nfrom rlctl.kit.ranks import RankGroup\nimport rlctl.kit.algo as F\n"
              "from rlctl.kit.algo import value_loss\nfrom rlctl_mine.options import Options\nfrom . import options\n"
              "import torch\nimport json\n")
    assert plugin_violations(Path("x.py"), source, "rlctl_mine", {"rlctl_mine", "rlctl_fsdp_learner"}) == []
