"""The warm start's dev-accuracy stopping rule, its step cap, its cache key, and its mask of environment text."""

from __future__ import annotations

import json
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlctl.config.load import load_config
from rlctl.models.warm_start import (ENV_SPAN, WarmStartWarning, _encode, _pad, _split_by_length,
                                     builtin_policy_dir, demonstration_spans, greedy_accuracy, sft, sft_loss,
                                     warm_start_info, warm_start_key)
from rlctl_tasks.arith import ArithOptions, ArithTask

SHAPE = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=64", "model.warm_start.batch_size=32", "model.warm_start.lr=1e-2"]
TASK = ArithOptions(num_terms=2, max_operand=9, ops="+", num_train=70, num_dev=15, num_hidden=15)


@pytest.fixture(scope="module")
def task():
    return ArithTask(TASK).load()


def fresh_model(seed: int = 0):
    from rlctl.models.load import build_tiny
    from rlctl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = load_config(None, SHAPE).model
    return build_tiny(cfg, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed), tok


def run_sft(task, **kw):
    model, tok = fresh_model()
    checks: list[tuple[int, float]] = []
    result = sft(model, tok, task.train, batch_size=32, lr=1e-2, seed=0, dev=task.train[:40],
                 progress=lambda step, total, loss, *dev: checks.append((step, dev[0])) if dev else None, **kw)
    return result, checks, model, tok


def test_sft_stops_at_the_first_check_that_reaches_the_target(task) -> None:
    # First the whole trajectory with an unreachable target, then a target it reaches part-way.
    full, checks, _, _ = run_sft(task, steps=240, target=1.0, eval_every=40)
    assert [s for s, _ in checks] == [40, 80, 120, 160, 200, 240]
    assert full.steps == 240 and full.reached is False
    best = max(acc for _, acc in checks)
    assert best > 0.1, f"the tiny model learned nothing in 240 steps: {checks}"
    first_hit = next(step for step, acc in checks if acc >= best)
    assert first_hit < 240 or best == checks[-1][1]

    stopped, seen, model, tok = run_sft(task, steps=240, target=best, eval_every=40)
    assert stopped.reached is True and stopped.target == best
    assert stopped.steps == first_hit  # the first check at or above the target, not a later one
    assert seen == [c for c in checks if c[0] <= first_hit]  # same trajectory up to the stop (seeded)
    assert stopped.dev_accuracy == pytest.approx(best)
    assert greedy_accuracy(model, tok, task.train[:40]) == pytest.approx(best)  # the returned model is the stopped one
    assert len(stopped.losses) == first_hit


def test_sft_without_target_runs_every_step_and_never_evaluates(task) -> None:
    result, checks, _, _ = run_sft(task, steps=30)
    assert result.steps == 30 and checks == []
    assert result.reached is None and result.dev_accuracy is None


def test_builtin_warm_start_warns_at_the_cap_and_records_where_it_stopped(task, tmp_path) -> None:
    cfg = load_config(None, [*SHAPE, "model.warm_start.steps=20", "model.warm_start.target_dev_accuracy=1.0",
                             "model.warm_start.eval_every=10", "model.warm_start.eval_prompts=10"])
    with pytest.warns(WarmStartWarning, match=r"cap of 20 steps .* below its target 100%.*raise model\.warm_start\.steps"):
        path = builtin_policy_dir(cfg.model, task, 0, tmp_path)
    info = warm_start_info(path)
    assert info["steps"] == 20 and info["reached"] is False and info["target"] == 1.0
    assert 0.0 <= info["dev_accuracy"] < 1.0
    with pytest.warns(WarmStartWarning, match="cap of 20 steps"):  # the cached entry says so again
        assert builtin_policy_dir(cfg.model, task, 0, tmp_path) == path


def test_builtin_warm_start_that_reaches_its_target_is_silent(task, tmp_path) -> None:
    cfg = load_config(None, [*SHAPE, "model.warm_start.steps=200", "model.warm_start.target_dev_accuracy=0.01",
                             "model.warm_start.eval_every=20"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", WarmStartWarning)
        path = builtin_policy_dir(cfg.model, task, 0, tmp_path)
    info = json.loads((path / "warm_start.json").read_text())
    assert info["reached"] is True and info["dev_accuracy"] >= 0.01 and info["steps"] % 20 == 0


def test_cache_key_covers_the_stopping_rule_and_pins_the_warm_start_seed(task) -> None:
    def key(*overrides: str, seed: int = 0) -> str:
        return warm_start_key(load_config(None, [*SHAPE, *overrides]).model, task, seed)

    base = key("model.warm_start.target_dev_accuracy=0.4")
    assert key("model.warm_start.target_dev_accuracy=0.5") != base
    assert key("model.warm_start.target_dev_accuracy=0.4", "model.warm_start.eval_every=50") != base
    assert key("model.warm_start.target_dev_accuracy=0.4", "model.warm_start.eval_prompts=20") != base
    assert key() != base  # no target at all
    # warm_start.seed defaults to run.seed; pinned, the RL seed no longer changes the warm start
    assert key("model.warm_start.target_dev_accuracy=0.4", "model.warm_start.seed=0", seed=0) == base
    assert key("model.warm_start.target_dev_accuracy=0.4", "model.warm_start.seed=0", seed=5) == base
    assert key("model.warm_start.target_dev_accuracy=0.4", seed=5) != base


# -- tool-using demonstrations: SFT trains on the policy's tokens only --------------------------------------------


def test_demonstration_spans_cut_out_what_the_environment_wrote() -> None:
    assert demonstration_spans("<calc>37*48</calc><out>1776</out>1776") == [
        ("<calc>37*48</calc>", True), ("<out>1776</out>", False), ("1776", True)]
    assert demonstration_spans("1776") == [("1776", True)]
    assert demonstration_spans("<out>1</out><out>2</out>") == [("<out>1</out>", False), ("<out>2</out>", False)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text(alphabet="0123456789*<>/calcout", max_size=8), st.booleans()), max_size=6))
def test_demonstration_spans_are_a_partition_that_marks_every_out_tag(parts: list[tuple[str, bool]]) -> None:
    text = "".join(f"<out>{p}</out>" if env and "</out>" not in p else p for p, env in parts)
    spans = demonstration_spans(text)
    assert "".join(piece for piece, _ in spans) == text and all(spans)
    for piece, policy in spans:
        assert policy == (ENV_SPAN.fullmatch(piece) is None)
        if policy:
            assert ENV_SPAN.search(piece) is None


def test_sft_loss_masks_the_prompt_and_the_environments_tokens() -> None:
    from rlctl import PromptRecord, Split

    model, tok = fresh_model()
    record = PromptRecord(id="t", text="37*48=", answer="1776", split=Split.TRAIN,
                          demonstration="<calc>37*48</calc><out>1776</out>1776")
    ids, trained = _encode(tok, record)
    assert tok.decode(ids, skip_special_tokens=True) == "37*48=<calc>37*48</calc><out>1776</out>1776"
    kept = "".join(tok.convert_ids_to_tokens([i for i, t in zip(ids, trained) if t]))
    assert kept == "<calc>37*48</calc>1776<eos>"  # not the prompt, not <out>1776</out>
    # gradient check: the logits that predict a prompt or environment token get exactly zero gradient
    captured = {}

    def keep_logits(module, inputs, output):
        output.retain_grad()
        captured["logits"] = output

    hook = model.lm_head.register_forward_hook(keep_logits)
    try:
        sft_loss(model, *_pad([(ids, trained)], tok.pad_token_id)).backward()
    finally:
        hook.remove()
    grad = captured["logits"].grad[0]  # [T, V]; row p predicts token p + 1
    for pos in range(1, len(ids)):
        assert bool(grad[pos - 1].abs().sum() > 0) == trained[pos], (pos, tok.convert_ids_to_tokens(ids[pos]))


def test_cache_key_covers_the_environment_mask_only_when_demonstrations_call_tools() -> None:
    cfg = load_config(None, SHAPE).model
    opts = ArithOptions(num_terms=2, max_operand=20, ops="*", num_train=60, num_dev=10, num_hidden=10)
    plain = ArithTask(opts).load()
    tools = ArithTask(opts.model_copy(update={"tool_demo_fraction": 0.25})).load()
    assert warm_start_key(cfg, plain, 0) != warm_start_key(cfg, tools, 0)
    # the quickstart's warm start (no tool demonstrations) keeps the key it had before environments existed
    quickstart = load_config("configs/quickstart.yaml", [])
    data = ArithTask(ArithOptions(**quickstart.task.options)).load()
    assert warm_start_key(quickstart.model, data, 0) == "ceeb83093254e4af"  # measured before tool demonstrations


def test_a_dev_accuracy_target_is_refused_when_demonstrations_call_tools(tmp_path) -> None:
    """The dev check decodes without the environment: on tool demonstrations it would stop at the wrong point."""
    from rlctl.contracts.errors import ConfigError

    cfg = load_config(None, [*SHAPE, "model.warm_start.steps=5", "model.warm_start.target_dev_accuracy=0.5"])
    opts = ArithOptions(num_terms=2, max_operand=20, ops="*", num_train=60, num_dev=10, num_hidden=10,
                        tool_demo_fraction=0.25)
    with pytest.raises(ConfigError, match=r"target_dev_accuracy.*without the environment") as err:
        builtin_policy_dir(cfg.model, ArithTask(opts).load(), 0, tmp_path)
    assert "fixed model.warm_start.steps" in err.value.hint and not any(tmp_path.iterdir())  # nothing written


def test_a_batch_of_short_answers_and_a_few_tool_calls_is_padded_in_two_blocks_with_the_same_loss() -> None:
    import torch

    from rlctl import PromptRecord, Split

    model, tok = fresh_model()
    direct = [PromptRecord(id=f"d{i}", text=f"{i}*7=", answer=str(7 * i), split=Split.TRAIN) for i in range(12)]
    tools = [PromptRecord(id=f"t{i}", text=f"{i}*7=", answer=str(7 * i), split=Split.TRAIN,
                          demonstration=f"<calc>{i}*7</calc><out>{7 * i}</out>{7 * i}") for i in range(3)]
    rows = [_encode(tok, r) for r in direct + tools]
    blocks = _split_by_length(rows)
    assert [len(b) for b in blocks] == [12, 3]
    assert _split_by_length([_encode(tok, r) for r in direct]) == [[_encode(tok, r) for r in direct]]  # no gain
    parts = [_pad(b, tok.pad_token_id) for b in blocks]
    counts = [int((labels[:, 1:] != -100).sum()) for _, labels, _ in parts]
    split = sum(sft_loss(model, *p) * n for p, n in zip(parts, counts)) / sum(counts)
    with torch.no_grad():
        assert float(split) == pytest.approx(float(sft_loss(model, *_pad(rows, tok.pad_token_id))), rel=1e-5)
