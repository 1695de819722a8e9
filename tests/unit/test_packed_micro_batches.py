"""Packed learner micro-batches (train.micro_batch_tokens): the same numbers as the padded path.

For every registered estimator's policy loss and both KL placements, a packed
learner and a padded one train on the same 16-sequence batch: gradients, the
pre-step log-probs (what D_lag is computed from), the reference log-probs and
the step's loss / KL / ratio metrics agree within 1e-6 relative (metrics that
are differences of log-probs, such as approx_kl_behavior, within 1e-6
absolute: at the first step they are float noise around 0). The models run
in float64 there, so that the comparison sees the maths and not the order in
which a GEMM of another shape sums in fp32 (the loss itself is fp32 on both
sides); in float32, gradients agree within 1e-5 of their norm. With one
micro-batch on each side the partition is the same, so every metric must
match; with several packed micro-batches (and an uneven last one) the
gradients and log-probs must still match, since each micro-batch's loss is
weighted by its share of the whole mini-batch.
"""

from __future__ import annotations

import pytest
import torch

from rlctl import ConfigError
from rlctl.contracts.types import LearnerContext
from rlctl.kit.packing import pack_rows
from tests.helpers import rollout_batch

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "dapo", "ppo"]
RTOL = 1e-6
# the metrics of one step that must not depend on how its rows are forwarded
METRICS = ("loss", "clip_fraction", "ratio_mean", "ratio_max", "approx_kl_behavior", "kl_ref", "entropy",
           "logprob_mismatch_mean", "logprob_mismatch_max", "grad_norm")


@pytest.fixture(scope="module")
def session(tiny_config, plugins, _rlctl_home):
    from tests.helpers import build_roles

    s = build_roles(tiny_config, plugins, cache_root=_rlctl_home / "cache")
    yield s
    s.rollout.close()


@pytest.fixture(scope="module")
def batch(session):
    advantages = [(-1.0) ** i * (1 + i % 3) for i in range(16)]
    return rollout_batch(session, advantages=advantages)[1]


def make(session, plugins, name: str = "grpo", tokens: int | None = None, size: int = 16, kl: str | None = None,
         fp64: bool = True, share: bool = False, **algo):
    from rlctl.kit import TorchLearner, TorchLearnerOptions
    from rlctl.placement.build import build_estimator, policy_loss

    cfg = session.config.model_copy(deep=True)
    cfg.algo = cfg.algo.model_copy(update={"name": name, "micro_batch_size": size, **algo})
    if kl is not None:
        cfg.algo.kl = cfg.algo.kl.model_copy(update={"coef": 0.3, "placement": kl})
    loss = policy_loss(cfg, build_estimator(cfg, plugins))
    ctx = LearnerContext(model_dir=str(session.policy_dir), algo=cfg.algo,
                         optim=cfg.train.optim.model_copy(update={"lr": 1e-3, "grad_clip": 1e6}), seed=0,
                         max_response_tokens=cfg.rollout.max_tokens, deterministic=True, policy_loss=loss,
                         micro_batch_tokens=tokens)
    lrn = TorchLearner(ctx, TorchLearnerOptions(share_prompt_prefill=share))
    if fp64:  # in place: the optimizer keeps the same parameter objects
        for model in (lrn.model, lrn.reference):
            if model is not None:
                model.double()
    return lrn


def close(a: torch.Tensor, b: torch.Tensor, what: str, floor: float | None = None, scale: float = 1.0) -> None:
    """|a - b| <= 1e-6 |b| elementwise, with a floor of 1e-6 of b's largest magnitude for values near 0.

    ``scale`` widens both for the shared-prompt layout: HF's Llama computes RMSNorm and the attention softmax in
    float32 even in a float64 model, and forwarding a prompt once for its G responses changes the shapes those
    fp32 ops see; on an AMD EPYC host that moved a layernorm weight's gradient by 1.2e-6 of its largest
    element (bit-equal on an Intel host)."""
    floor = RTOL * scale * float(b.abs().max()) + 1e-12 if floor is None else floor
    torch.testing.assert_close(a.double(), b.double(), rtol=RTOL * scale, atol=floor, msg=what)


def step(lrn, batch):
    stats, before = lrn.train_step_with_logprobs(batch)
    grads = {n: p.grad.clone() for n, p in lrn.model.named_parameters() if p.grad is not None}
    return stats, before, grads


def compare(packed, padded, batch, metrics: tuple[str, ...], scale: float = 1.0) -> None:
    s1, b1, g1 = step(packed, batch)
    s2, b2, g2 = step(padded, batch)
    on = batch.action_mask > 0
    close(b1[on], b2[on], "pre-step log-probs")
    assert g1.keys() == g2.keys() and g1
    for name in g1:
        close(g1[name], g2[name], name, scale=scale)
    for key in metrics:
        if key in s2:
            close(torch.tensor(s1[key]), torch.tensor(s2[key]), key, floor=RTOL)


@pytest.mark.parametrize("share", [False, True], ids=["packed", "packed-shared-prompts"])
@pytest.mark.parametrize("kl", [None, "loss", "reward"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_one_packed_micro_batch_equals_the_padded_one(session, plugins, batch, name, kl, share):
    packed = make(session, plugins, name, tokens=10_000, kl=kl, share=share)
    compare(packed, make(session, plugins, name, kl=kl), batch, METRICS, scale=10.0 if share else 1.0)


@pytest.mark.parametrize("share", [False, True], ids=["packed", "packed-shared-prompts"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_several_packed_micro_batches_give_the_same_gradients_and_log_probs(session, plugins, batch, name, share):
    packed = make(session, plugins, name, tokens=45, kl="loss", share=share)
    assert len(list(packed._micro_batches(batch))) > 3
    compare(packed, make(session, plugins, name, size=5, kl="loss"), batch, ("grad_norm",), scale=10.0 if share else 1.0)


def test_shared_prompts_are_forwarded_once_in_the_packed_row(session, plugins, batch):
    from rlctl.kit.packing import shared_layout

    layout = shared_layout(batch.select(range(8)))  # 2 prompts x 4 responses
    assert layout is not None
    flat, _, groups, index, _ = layout
    assert len(groups) == 2 and [len(g[2]) for g in groups] == [4, 4]
    assert len(flat) == int(batch.select(range(8)).attention_mask.sum()) - 3 * (groups[0][1] + groups[1][1])
    assert shared_layout(batch.select([0, 4, 8, 12])) is None  # nothing shared: the plain packed row


def test_log_probs_reference_and_truncated_importance_sampling_match(session, plugins, batch):
    packed = make(session, plugins, tokens=45, kl="reward", tis_cap=2.0)
    padded = make(session, plugins, size=3, kl="reward", tis_cap=2.0)
    on = batch.action_mask > 0
    close(packed.logprobs(batch)[on], padded.logprobs(batch)[on], "log-probs")
    close(packed.ref_logprobs(batch)[on], padded.ref_logprobs(batch)[on], "reference log-probs")
    assert float(packed.logprobs(batch)[batch.attention_mask == 0].abs().max()) == 0.0  # nothing on padding
    compare(packed, padded, batch, ("grad_norm",))


def test_in_float32_gradients_agree_within_float_rounding(session, plugins, batch):
    _, b1, g1 = step(make(session, plugins, "gspo", tokens=45, kl="loss", fp64=False), batch)
    _, b2, g2 = step(make(session, plugins, "gspo", size=5, kl="loss", fp64=False), batch)
    on = batch.action_mask > 0
    close(b1[on], b2[on], "pre-step log-probs")
    for name in g1:
        assert float((g1[name] - g2[name]).norm()) <= 1e-5 * float(g2[name].norm()), name


def test_mini_batches_and_epochs_take_the_same_updates(session, plugins, batch):
    packed = make(session, plugins, tokens=45, num_mini_batches=2, ppo_epochs=2)
    padded = make(session, plugins, size=4, num_mini_batches=2, ppo_epochs=2)
    packed.train_step(batch)
    padded.train_step(batch)
    # Adam turns a gradient element near its eps (1e-8) into a step of about lr whatever the element's size, so
    # fp64 summation-order differences there move a parameter by a small fraction of lr (3.6e-7 measured on one
    # machine, 0 on another): the floor is 1e-3 of the learning rate, 1e-6, not 1e-6 of the parameter's size.
    for (name, p1), p2 in zip(packed.model.named_parameters(), padded.model.parameters()):
        close(p1.detach(), p2.detach(), name, floor=1e-3 * 1e-3)


def test_rows_are_packed_in_order_under_the_budget_and_a_long_row_stands_alone():
    assert pack_rows([3, 4, 2, 9, 1, 1], budget=8, max_rows=64) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    assert pack_rows([3, 3, 3, 3], budget=100, max_rows=3) == [range(0, 3), range(3, 4)]
    assert pack_rows([20, 2], budget=8, max_rows=64) == [range(0, 1), range(1, 2)]  # longer than the budget
    assert pack_rows([], budget=8, max_rows=64) == []


def test_a_budget_that_cannot_hold_one_response_is_a_config_error():
    from rlctl.config.load import load_config

    with pytest.raises(ConfigError, match="micro_batch_tokens=12 cannot hold"):
        load_config(None, ["rollout.max_tokens=12", "train.micro_batch_tokens=12"])
    assert load_config(None, ["train.micro_batch_tokens=512"]).train.micro_batch_tokens == 512


def _deterministic_run(plugins, home, extra: list[str]):
    from rlctl.config.load import load_config
    from rlctl.engine.loop import run_sync
    from rlctl.engine.spec import LoopSpec
    from tests.conftest import TINY_OVERRIDES
    from tests.helpers import build_roles
    from tests.integration.test_estimators_loop import ListSink

    cfg = load_config(None, [*TINY_OVERRIDES, "train.deterministic=true", "train.steps=3", "train.optim.lr=1e-3",
                             "algo.micro_batch_size=8", *extra])
    session = build_roles(cfg, plugins, home / "cache")
    try:
        sink = ListSink()
        run_sync(session, LoopSpec.from_config(session.config), [sink])
        weights = {k: v.detach().clone() for k, v in session.learner.model.state_dict().items()}
        return sink.rows, weights, session
    finally:
        session.rollout.close()


def test_a_deterministic_packed_ppo_run_with_a_critic_repeats_bit_for_bit(plugins, _rlctl_home):
    extra = ["train.micro_batch_tokens=40", "algo.name=ppo", "algo.critic.warmup_steps=1", "algo.kl.coef=0.05"]
    rows1, w1, s1 = _deterministic_run(plugins, _rlctl_home, extra)
    rows2, w2, _ = _deterministic_run(plugins, _rlctl_home, extra)
    assert s1.critic is not None and s1.learner.micro_batch_tokens == 40
    last = rows1[max(rows1)]
    assert last["policy_version"] == 2.0 and "value_loss" in last and "kl_ref" in last
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    timing = ("time", "wall", "elapsed", "per_s", "_s", "throughput", "tokens_s", "host_load", "cpu_frac")  # + machine load
    assert rows1.keys() == rows2.keys()
    for step in rows1:
        a, b = rows1[step], rows2[step]
        same = sorted(k for k in a if not k.startswith("T_") and not any(t in k for t in timing))
        assert all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in same), step  # NaN equals NaN


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_forward_equals_padded_for_llama_and_qwen2(arch, attention):
    """Both packed attentions (per-sequence sdpa, and transformers' own packed-sequence mask from the position
    ids) give the padded forward's log-probs, in float64 to 1e-12."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from rlctl.contracts.batch import TrainBatch
    from rlctl.contracts.types import SamplingConfig
    from rlctl.kit.packing import packed_logprobs, use_segment_attention

    kw = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, attn_implementation=attention)
    torch.manual_seed(0)
    model = (LlamaForCausalLM(LlamaConfig(**kw)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**kw)))
    model = model.double().eval()
    lengths = [5, 17, 1, 30, 9]
    ids = torch.randint(1, 40, (5, 32))
    mask = (torch.arange(32)[None] < torch.tensor(lengths)[:, None]).long()
    zeros = torch.zeros((5, 32))
    batch = TrainBatch(input_ids=ids * mask, attention_mask=mask, action_mask=mask.float(), behavior_logprobs=zeros,
                       advantages=zeros, sampling=SamplingConfig(temperature=0.7, max_tokens=30), trajectory_ids=("a",) * 5,
                       policy_versions=(0,) * 5)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=pos).logits[:, :-1]
        want = torch.nn.functional.pad(torch.log_softmax(logits.double() / 0.7, -1).gather(
            -1, batch.input_ids[:, 1:, None]).squeeze(-1), (1, 0))
        real = (mask > 0) & (torch.arange(32)[None] > 0)
        native = packed_logprobs(model, batch, with_entropy=False)[0]
        use_segment_attention(model)
        assert model.config._attn_implementation == "rlctl_segments"
        segments = packed_logprobs(model, batch, with_entropy=False)[0]
    for got in (native, segments):
        torch.testing.assert_close(got[real].double(), want[real], rtol=1e-6, atol=1e-6)
        assert float(got[~real].abs().max()) == 0.0


def test_an_out_of_memory_halves_the_token_budget_and_the_step_is_the_same(session, plugins, batch):
    packed = make(session, plugins, tokens=45)
    forward, calls = packed._forward, []

    def once(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("injected")
        return forward(*args, **kw)

    packed._forward = once
    s1, b1, g1 = step(packed, batch)
    s2, b2, g2 = step(make(session, plugins, size=5), batch)
    assert packed.micro_batch_tokens == 22 and packed.micro_batch_size == 8 and s1["oom_recoveries"] == 1.0
    assert packed._counters()["micro_batch_tokens"] == 22
    for name in g1:
        close(g1[name], g2[name], name)


def test_learner_token_counts_for_rlctl_profile(session, plugins, batch):
    """Padded micro-batches compute the batch's width for every row, shared-prompt prefill each distinct prompt
    once and responses to the longest, packed ones only real tokens; one forward + backward weighs 3."""
    mask = batch.attention_mask
    padded = step(make(session, plugins, size=8), batch)[0]
    assert padded["learner_real_tokens"] == float(mask.sum()) and padded["learner_computed_tokens"] == mask.numel()
    assert padded["learner_flop_tokens"] == 3 * float(mask.sum())
    assert padded["learner_padding_waste"] == pytest.approx(1 - float(mask.sum()) / mask.numel())
    assert 0 < padded["learner_padding_waste"] < 1
    packed = step(make(session, plugins, tokens=10_000), batch)[0]
    assert packed["learner_padding_waste"] == 0.0 and packed["learner_real_tokens"] == float(mask.sum())
    shared = step(make(session, plugins, size=8, share=True), batch)[0]
    assert shared["learner_real_tokens"] < float(mask.sum())  # the G copies of a prompt forward once
    assert shared["learner_computed_tokens"] < padded["learner_computed_tokens"]
    assert 0 <= shared["learner_padding_waste"] < 1
    packed_shared = step(make(session, plugins, tokens=10_000, share=True), batch)[0]
    assert packed_shared["learner_padding_waste"] == 0.0
    assert packed_shared["learner_real_tokens"] < packed["learner_real_tokens"]  # a shared prompt forwards once


# -- the critic (algo.name: ppo) packs its micro-batches like the policy learner --------------------------------------

CRITIC_METRICS = ("value_loss", "value_clip_fraction", "critic_grad_norm", "explained_variance", "value_mean")


def make_critic(session, plugins, tokens: int | None = None, size: int = 16, clip: float | None = 0.2,
                fp64: bool = True):
    """The torch critic of a ppo config, its head drawn at random (zero-initialised, the backbone would get no
    gradient at the first step), in float64 like the policy above."""
    from rlctl.placement.build import build_critic

    cfg = session.config.model_copy(deep=True)
    cfg.algo = cfg.algo.model_copy(update={"name": "ppo", "micro_batch_size": size})
    cfg.algo.critic = cfg.algo.critic.model_copy(update={"value_clip": clip, "epochs": 2})
    cfg.train = cfg.train.model_copy(update={"micro_batch_tokens": tokens})
    cfg.train.optim = cfg.train.optim.model_copy(update={"grad_clip": 1e6})
    critic = build_critic(cfg, plugins, session.policy_dir)
    assert critic.micro_batch_tokens == tokens
    head = critic.model.head
    with torch.no_grad():
        head.weight.copy_(0.3 * torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(7)))
    if fp64:
        critic.model.double()
    return critic


def critic_targets(batch, values: torch.Tensor, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns and old values on the trained tokens, far enough from the values that the clip bites."""
    gen = torch.Generator().manual_seed(seed)
    on = batch.action_mask > 0
    returns = torch.where(on, torch.randn(values.shape, generator=gen), 0.0)
    old = torch.where(on, values + 0.4 * torch.randn(values.shape, generator=gen), 0.0)
    return returns, old


def compare_critics(packed, padded, batch, metrics: tuple[str, ...]) -> None:
    """Values before, the step's metrics and gradients (of its last epoch), and the values after the step."""
    v1, v2 = packed.values(batch), padded.values(batch)
    close(v1, v2, "values")
    assert float(v1[batch.action_mask == 0].abs().max()) == 0.0  # no value off the policy's tokens
    returns, old = critic_targets(batch, v2)
    s1, s2 = packed.train_step(batch, returns, old), padded.train_step(batch, returns, old)
    assert s2["value_clip_fraction"] > 0.05 or padded.cfg.value_clip is None  # the clipped branch is exercised
    for key in metrics:
        close(torch.tensor(s1[key]), torch.tensor(s2[key]), key, floor=RTOL)
    g1 = {n: p.grad for n, p in packed.model.named_parameters() if p.grad is not None}
    g2 = {n: p.grad for n, p in padded.model.named_parameters() if p.grad is not None}
    assert g1.keys() == g2.keys() and any(n.startswith("backbone.") for n in g1)
    for name in g1:
        close(g1[name], g2[name], name)
    close(packed.values(batch), padded.values(batch), "values after the step")


@pytest.mark.parametrize("clip", [0.2, None], ids=["value-clip", "no-clip"])
def test_one_packed_critic_micro_batch_equals_the_padded_one(session, plugins, batch, clip):
    packed = make_critic(session, plugins, tokens=10_000, clip=clip)
    assert len(list(packed._micro(batch))) == 1
    compare_critics(packed, make_critic(session, plugins, clip=clip), batch, CRITIC_METRICS)


def test_several_packed_critic_micro_batches_give_the_same_values_and_gradients(session, plugins, batch):
    packed = make_critic(session, plugins, tokens=45)
    assert len(list(packed._micro(batch))) > 3
    # the micro-batches are cut from each epoch's shuffled row order, so the partitions differ from the padded one;
    # each micro-batch's loss is weighted by its share of the trained tokens, so the gradient is the same sum
    compare_critics(packed, make_critic(session, plugins, size=5), batch,
                    ("critic_grad_norm", "explained_variance", "value_mean"))


def test_packed_critic_micro_batches_hold_whole_rows_under_the_budget(session, plugins, batch):
    critic = make_critic(session, plugins, tokens=45, size=4, fp64=False)
    order = torch.randperm(batch.num_sequences, generator=torch.Generator().manual_seed(0))
    lengths = batch.attention_mask.sum(-1)
    micros = list(critic._micro(batch, order))
    assert torch.equal(torch.cat(micros), order)  # every row once, in the shuffled order
    assert all(len(m) <= 4 and (int(lengths[m].sum()) <= 45 or len(m) == 1) for m in micros)
