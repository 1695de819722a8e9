"""rlctl.kit, the plugin kit: every published name resolves, is documented where it is defined, loads lazily,
and docs/plugins.md lists exactly these names."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import rlctl.kit as kit

REPO = Path(__file__).resolve().parents[2]


def _own_doc(obj: object) -> str:
    """The docstring written at ``obj``'s definition (a class's own, never one inherited from its base)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return (doc or "").strip()


@pytest.mark.parametrize("name", kit.__all__)
def test_every_kit_name_resolves_and_has_a_docstring_at_its_definition(name):
    obj = getattr(kit, name)
    assert _own_doc(obj), f"rlctl.kit.{name} has no docstring where it is defined"
    if not inspect.ismodule(obj):  # re-exported as it is: the object of its home module, not a copy
        assert getattr(importlib.import_module(kit._HOME_OF[name]), name) is obj


def test_kit_names_are_unique_and_unknown_names_fail_plainly():
    assert len(kit.__all__) == len(set(kit.__all__))
    assert set(kit.__all__) <= set(dir(kit))
    with pytest.raises(AttributeError, match="rlctl.kit.*no_such_helper"):
        kit.no_such_helper  # noqa: B018


def test_the_learner_base_and_rank_plumbing_live_in_the_kit_not_in_a_plugin():
    from rlctl_deepspeed_learner.learner import DeepSpeedLearner
    from rlctl_fsdp_learner.learner import FsdpLearner

    for learner in (FsdpLearner, DeepSpeedLearner):
        assert issubclass(learner, kit.RankGroup) and issubclass(learner, kit.ShardedCheckpoints)
        assert issubclass(learner.make_rank, kit.TorchLearner)
    assert importlib.util.find_spec("rlctl_torch_learner.learner") is None  # the plugin registers the kit's


def test_importing_the_kit_and_its_light_names_does_not_import_torch():
    code = ("import sys\nimport rlctl.kit\nfrom rlctl.kit import server_urls, parse_bytes, TorchLearnerOptions, "
            "FaultContext, arm, fault_site, report_recovery\n"
            "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_docs_plugins_page_lists_exactly_the_kit():
    spec = importlib.util.spec_from_file_location("kit_table", REPO / "scripts" / "kit_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = (REPO / "docs" / "plugins.md").read_text()
    assert module.current(page) == module.table(), "run: python scripts/kit_table.py --write"
    for name in kit.__all__:
        assert f"| `{name}` |" in page
