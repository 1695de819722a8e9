"""configs/quickstart-tools.yaml (the calculator demonstration task) is valid, trains a tiny step on episodes,
and its end-of-run eval runs episodes and reports the tool-call rate of both policies."""

from __future__ import annotations

import json

from rlctl.config.load import load_config
from tests.conftest import TINY_OVERRIDES
from tests.integration.test_cli import REPO, rlctl

CONFIG = REPO / "configs" / "quickstart-tools.yaml"
# the tiny shape and sizes, but an episode's token budget: the tool call and its answer must fit
TINY = [o for o in TINY_OVERRIDES if not o.startswith(("rollout.max_tokens", "eval.max_tokens"))]


def test_quickstart_tools_is_the_multiplication_task_with_a_calculator():
    config = load_config(CONFIG)
    opts = config.task.options
    assert (config.task.source, opts["ops"], opts["max_operand"]) == ("arith", "*", 99)
    assert 0 < opts["tool_demo_fraction"] < 0.5  # the warm start calls the tool on a minority of prompts
    env = config.rollout.environment
    assert env is not None and env.name == "tools"
    assert env.options["tools"] == {opts["tool_tag"]: {"tool": "calculator"}}  # demonstrations call this tool
    longest = len("<calc>99*99</calc><out>9801</out>9801") + 1  # + eos
    assert config.rollout.max_tokens >= longest and config.eval.max_tokens >= longest
    assert env.options["limits"]["max_total_tokens"] >= longest


def test_quickstart_tools_trains_a_tiny_step_and_evaluates_episodes(tmp_path):
    out = json.loads(rlctl("train", str(CONFIG), *TINY, "train.steps=1", "--json", home=tmp_path,
                           check=True, timeout=600).stdout)
    assert out["run"]["status"] == "succeeded"
    rates = out["eval"]["details"]["tool_call_rate"]
    assert set(rates) == {"start", "final"} and all(0.0 <= r <= 1.0 for r in rates.values())
