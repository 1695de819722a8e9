"""The ``tools`` environment and its tools: call syntax, who is to blame for a failure, the calculator's bounds."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from rlctl.config.models import EnvironmentConfig
from rlctl.contracts.errors import BadToolCall, ConfigError, ToolError
from rlctl.engine import faults
from rlctl.engine.episodes import build_environment
from rlctl.models.tokenizer import build_char_tokenizer
from rlctl_envs.calculator import Calculator, CalculatorOptions

TOK = build_char_tokenizer()


def _env(plugins, **options):
    options.setdefault("tools", {"calc": {"tool": "calculator"}})
    return build_environment(plugins, EnvironmentConfig(name="tools", options=options), TOK)


def _step(env, text: str, eos: bool = False):
    ids = TOK.encode(text, add_special_tokens=False) + ([TOK.eos_token_id] if eos else [])
    return env.start("p", (1,)).step(ids)


def _text(step) -> str:
    return TOK.decode(list(step.observation))


# ---- calculator ------------------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6), st.sampled_from(["+", "-", "*", "//", "%"]))
def test_calculator_matches_python_integer_arithmetic(a, b, op):
    expr = f"({a}){op}({b})"
    if op in ("//", "%") and b == 0:
        with pytest.raises(BadToolCall, match="division by zero"):
            Calculator().call(expr, 1.0)
        return
    assert Calculator().call(expr, 1.0) == str({"+": a + b, "-": a - b, "*": a * b, "//": a // b if b else 0,
                                                 "%": a % b if b else 0}[op])


@settings(max_examples=100, deadline=None)
@given(st.integers(-999, 999), st.integers(1, 999))
def test_calculator_division_is_exact_enough(a, b):
    assert Fraction(Calculator().call(f"{a}/{b}", 1.0)) == pytest.approx(Fraction(a, b), rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*/%().e _abcxyz", max_size=40))
def test_calculator_never_raises_anything_but_a_bad_call(text):
    try:
        out = Calculator().call(text, 1.0)
    except BadToolCall as err:
        assert err.message
    else:
        assert isinstance(out, str) and out


@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('true')", "unsupported"), ("abs(-1)", "unsupported"), ("x+1", "name 'x'"),
    ("9**9**9", "too large"), ("2**100000", "too large"), ("1e308*10", "finite"), ("(-8)**0.5", "complex"),
    ("1" * 300, "longer than"), ("", "empty"), ("1+", "cannot parse"), ("[1]", "unsupported"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expr, why):
    with pytest.raises(BadToolCall, match=why):
        Calculator(CalculatorOptions()).call(expr, 1.0)


# ---- syntax and step semantics --------------------------------------------------------------------------------

_TEXT = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30)


@settings(max_examples=200, deadline=None)
@given(_TEXT, _TEXT.filter(lambda a: "</calc>" not in a), st.sampled_from(["", " ", "  "]))
def test_tags_parser_returns_the_arguments_of_the_call_that_ends_the_turn(plugins, before, args, trailing):
    env = _env(plugins)
    assert env.parse(f"{before}<calc>{args}</calc>{trailing}") == ("calc", args)


@settings(max_examples=200, deadline=None)
@given(_TEXT)
def test_tags_parser_on_any_text_finds_a_call_says_none_or_blames_the_policy(plugins, text):
    try:
        found = _env(plugins).parse(text)
    except BadToolCall as err:
        assert err.message
    else:
        assert found is None or (found[0] == "calc" and text.rstrip().endswith("</calc>"))


def test_tags_call_is_answered_with_out_tokens_encoded_by_the_environment(plugins):
    env = _env(plugins)
    assert env.stop == ("</calc>",)
    step = _step(env, "so <calc>37*48</calc>")
    assert (step.done, step.tool, step.tool_status) == (False, "calc", "ok")
    assert step.observation == tuple(TOK.encode("<out>1776</out>", add_special_tokens=False))


def test_a_turn_without_a_call_or_ending_in_eos_ends_the_episode(plugins):
    env = _env(plugins)
    assert _step(env, "1776", eos=True).done
    assert _step(env, "the answer is 12").done
    assert _step(env, "<calc>1+1</calc>", eos=True).done  # EOS: the policy ended its answer


@pytest.mark.parametrize("text, why", [
    ("<calc>1/0</calc>", "error: division by zero"),
    ("1+1</calc>", "error: </calc> without <calc>"),
    ("<calc>import os</calc>", "error: cannot parse"),
])
def test_a_bad_call_is_the_policys_mistake_a_normal_observation(plugins, text, why):
    step = _step(_env(plugins), text)
    assert not step.done and step.tool_status == "invalid"
    assert _text(step).startswith(f"<out>{why}") and _text(step).endswith("</out>")


def test_unknown_tool_in_tags_is_invalid(plugins):
    step = _step(_env(plugins, tools={"calc": {"tool": "calculator"}, "add": {"tool": "calculator"}}), "<mul>2</mul>")
    assert step.tool_status == "invalid" and "unknown tool 'mul'" in _text(step)


def test_hermes_syntax(plugins):
    env = _env(plugins, syntax="hermes", tools={"calculator": {}})
    assert env.stop == ("</tool_call>",)
    step = _step(env, 'x <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')
    assert (step.tool, step.tool_status, _text(step)) == ("calculator", "ok", "<tool_response>42</tool_response>")
    assert _text(_step(env, '<tool_call>{"name": "calculator", "arguments": "2+2"}</tool_call>')).count("4") == 1
    bad = _step(env, "<tool_call>{not json}</tool_call>")
    assert bad.tool_status == "invalid" and "not JSON" in _text(bad)
    unknown = _step(env, '<tool_call>{"name": "search", "arguments": "x"}</tool_call>')
    assert unknown.tool_status == "invalid" and "unknown tool 'search'" in _text(unknown)


def test_observation_template_and_result_cap(plugins):
    env = _env(plugins, observation=" [result: {result}] ", max_result_chars=3)
    assert _text(_step(env, "<calc>12345*1</calc>")) == " [result: 123...] "


@pytest.mark.parametrize("raise_, status", [(TimeoutError("slow"), "timeout"), (ToolError("crashed"), "error"),
                                            (RuntimeError("bug"), "error")])
def test_tool_failures_at_the_fault_site_flag_the_step_and_leave_no_observation(plugins, raise_, status):
    env = _env(plugins)
    calls = []

    def handler(value, **info):
        calls.append(info)
        raise raise_

    disarm = faults.arm("tool.call", handler)
    try:
        step = _step(env, "<calc>1+1</calc>")
    finally:
        disarm()
    assert calls and calls[0]["tool"] == "calc" and calls[0]["arguments"] == "1+1" and calls[0]["episode"]
    assert (step.done, step.tool, step.tool_status, step.observation) == (True, "calc", status, ())


def test_a_hung_tool_is_a_timeout_after_step_timeout_s(plugins):
    env = _env(plugins, limits={"step_timeout_s": 0.2})
    disarm = faults.arm("tool.call", lambda value, **info: time.sleep(2.0))
    try:
        started = time.perf_counter()
        step = _step(env, "<calc>1+1</calc>")
    finally:
        disarm()
    assert step.tool_status == "timeout" and 0.2 <= step.tool_seconds < 1.0
    assert time.perf_counter() - started < 1.0


def test_garbage_from_a_tool_is_flagged(plugins):
    env = _env(plugins)
    disarm = faults.arm("tool.call", lambda value, **info: b"\x00\xff")
    try:
        step = _step(env, "<calc>1+1</calc>")
    finally:
        disarm()
    assert step.tool_status == "garbage" and step.done


def test_scripted_tools_makes_the_first_turn_a_real_call_whatever_the_policy_wrote(plugins):
    """``scripted-tools`` (drills, tests): the first turn calls the first tool with ``call`` through the fault site;
    a failed call leaves the episode as it was (the retry calls again); the turn after the answer ends it."""
    env = build_environment(plugins, EnvironmentConfig(name="scripted-tools", options={
        "tools": {"calc": {"tool": "calculator"}}, "call": "6*7"}), TOK)
    episode = env.start("p", (1,))
    calls = []

    def once(value, **info):
        calls.append(info["arguments"])
        if len(calls) == 1:
            raise TimeoutError("injected")
        return value

    disarm = faults.arm("tool.call", once)
    try:
        failed = episode.step(TOK.encode("no call here", add_special_tokens=False))
        answered = episode.step(TOK.encode("no call here", add_special_tokens=False))
    finally:
        disarm()
    assert calls == ["6*7", "6*7"] and (failed.tool_status, failed.done) == ("timeout", True)
    assert (answered.tool, answered.tool_status, _text(answered), answered.done) == ("calc", "ok", "<out>42</out>",
                                                                                      False)
    assert episode.step(TOK.encode("42", add_special_tokens=False)).done
    assert env.name == "scripted-tools" and "'6*7'" in env.version


def test_unknown_names_and_bad_options_fail_naming_the_config_path(plugins):
    with pytest.raises(ConfigError, match=r"rollout.environment.name: no environment named 'tool'.*'tools'"):
        build_environment(plugins, EnvironmentConfig(name="tool"), TOK)
    with pytest.raises(ConfigError, match=r"rollout.environment.options.tools.calc: no tool named 'calculater'"
                                          r".*did you mean 'calculator'"):
        _env(plugins, tools={"calc": {"tool": "calculater"}})
    with pytest.raises(ConfigError, match=r"rollout.environment.options"):
        _env(plugins, tools={"<bad>": {}})
    with pytest.raises(ConfigError, match=r"tools.calc.options"):
        _env(plugins, tools={"calc": {"tool": "calculator", "options": {"max_chars": 0}}})


def test_python_tool_runs_in_the_sandbox(plugins, needs_sandbox):
    env = _env(plugins, tools={"py": {"tool": "python"}}, limits={"step_timeout_s": 20})
    ok = _step(env, "<py>print(6*7)</py>")
    assert (ok.tool_status, _text(ok)) == ("ok", "<out>42</out>")
    raised = _step(env, "<py>1/0</py>")
    assert raised.tool_status == "invalid" and "ZeroDivisionError" in _text(raised)
    net = _step(env, "<py>import urllib.request; urllib.request.urlopen('http://127.0.0.1:9', timeout=1)</py>")
    assert net.tool_status == "invalid" and "error" in _text(net)


def test_python_tool_in_expression_mode_answers_the_value_from_the_sandbox(plugins, needs_sandbox):
    """``mode: expression`` makes the python tool a calculator that evaluates in the jail (quickstart-tools' task
    with the tool sandboxed)."""
    env = _env(plugins, tools={"calc": {"tool": "python", "options": {"mode": "expression"}}},
               limits={"step_timeout_s": 20})
    ok = _step(env, "<calc>37*48</calc>")
    assert (ok.tool, ok.tool_status, _text(ok)) == ("calc", "ok", "<out>1776</out>")
    bad = _step(env, "<calc>print(1); 2</calc>")  # a statement is not an expression: the policy's mistake
    assert bad.tool_status == "invalid" and "SyntaxError" in _text(bad)
    quote = _step(env, "<calc>')+__import__('os').system('id')#</calc>")  # stays a literal: no code of ours runs it
    assert quote.tool_status == "invalid"


def test_a_bad_environment_config_stops_the_run_before_any_model_loads(plugins, _rlctl_home):
    from rlctl.config.load import load_config
    from rlctl.placement import place
    from tests.conftest import TINY_OVERRIDES

    config = load_config(None, [*TINY_OVERRIDES, "rollout.environment={name: tools, options: {tools: "
                                                  "{calc: {tool: calculater}}}}"])
    with pytest.raises(ConfigError, match="rollout.environment.options.tools.calc: no tool named 'calculater'"):
        place(config, plugins, cache_root=_rlctl_home / "no-cache")
    assert not (_rlctl_home / "no-cache").exists()
