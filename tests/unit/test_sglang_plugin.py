"""The sglang rollout plugin against fakes of real SGLang servers, and the served API's schema."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from rlctl.contracts.errors import RoleError
from rlctl.contracts.types import RolloutContext, RolloutRequest, SamplingConfig, TerminalReason, WeightUpdate
from rlctl.models.fingerprint import fingerprint
from rlctl.serve.sglang_api import ApiError, Limits, parse_generate, parse_sampling

LIMITS = Limits(positions=256, vocab_size=100)
from tests.fixtures.fake_sglang import FakeSGLang


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    return d


@pytest.fixture()
def fakes():
    servers = [FakeSGLang(), FakeSGLang()]
    yield servers
    for s in servers:
        s.close()


def _backend(plugins, model_dir: Path, servers, tmp_path: Path, **options):
    opts = {"servers": [s.url for s in servers], "publish_dir": str(tmp_path / "pub"), "retries": 1,
            "retry_backoff_s": 0.01, "timeout_s": 10, **options}
    ctx = RolloutContext(model_dir=str(model_dir), tokenizer_hash="tok", seed=0)
    return plugins.build("rollout_backend", "sglang", opts, "rollout.options", ctx=ctx)


def _requests(n: int, sampling: SamplingConfig | None = None, group: int = 4) -> list[RolloutRequest]:
    s = sampling or SamplingConfig(max_tokens=8)
    return [RolloutRequest(prompt_id=f"p{i}", prompt_tokens=(1, 10 + i), group_size=group, sampling=s,
                           dataset_version="d") for i in range(n)]


def _update(version: int) -> WeightUpdate:
    state = {"w": torch.full((8, 8), float(version)), "b": torch.zeros(8)}
    return WeightUpdate(version=version, state_dict=state, fingerprint=fingerprint(state))


def test_start_syncs_every_server_to_the_run_model(plugins, model_dir, fakes, tmp_path):
    backend = _backend(plugins, model_dir, fakes, tmp_path)
    try:
        for fake in fakes:
            assert fake.updates == [{"model_path": str(model_dir), "weight_version": "0", "flush_cache": True}]
        assert backend.health()["ok"] and {s["kind"] for s in backend.health()["servers"]} == {"sglang"}
    finally:
        backend.close()


def test_groups_stay_on_one_server_and_become_trajectories_like_the_local_engine(plugins, model_dir, fakes,
                                                                                 tmp_path):
    backend = _backend(plugins, model_dir, fakes, tmp_path)
    try:
        requests = _requests(8)
        trajectories = backend.generate(requests)
        assert [t.prompt_id for t in trajectories] == [r.prompt_id for r in requests for _ in range(4)]
        assert [t.group_index for t in trajectories[:4]] == [0, 1, 2, 3]
        for fake in fakes:  # every prompt's G samples went to exactly one server
            prompts = [rid.split("/")[0] for rid in fake.generated_rids]
            assert all(prompts.count(p) == 4 for p in set(prompts))
        assert set(fakes[0].generated_rids).isdisjoint(fakes[1].generated_rids)
        assert all(f.generated_rids for f in fakes), "8 prompts should land on both servers"
        t = trajectories[0]
        assert t.verify() and t.policy_version == 0 and t.tokenizer_hash == "tok"
        assert t.response_tokens[-1] == 2 and t.terminal_reason == TerminalReason.EOS
        assert t.behavior_logprobs == pytest.approx((-0.5, -0.6, -0.7))
        assert len(t.action_mask) == len(t.response_tokens)
        short = backend.generate(_requests(1, SamplingConfig(max_tokens=2)))
        assert {x.terminal_reason for x in short} == {TerminalReason.LENGTH}
        body = fakes[0].bodies[0] if fakes[0].bodies else fakes[1].bodies[0]
        assert body["return_logprob"] is True and body["sampling_params"][0] == {
            "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0}
    finally:
        backend.close()


def test_weight_update_publishes_then_confirms_each_server(plugins, model_dir, fakes, tmp_path):
    backend = _backend(plugins, model_dir, fakes, tmp_path)
    try:
        backend.update_weights(_update(1))
        for fake in fakes:
            last = fake.updates[-1]
            assert last["weight_version"] == "1" and Path(last["model_path"]).name == "v00000001-full"
            assert (Path(last["model_path"]) / "manifest.json").is_file()
        assert backend.policy_version == 1 and {t.policy_version for t in backend.generate(_requests(2))} == {1}
    finally:
        backend.close()


def test_restarted_server_reporting_an_old_version_is_resynced_before_it_serves(plugins, model_dir, fakes,
                                                                                tmp_path):
    backend = _backend(plugins, model_dir, fakes, tmp_path)
    try:
        backend.update_weights(_update(1))
        backend.update_weights(_update(2))
        fakes[1].weight_version = "default"  # what a freshly restarted SGLang reports
        before = len(fakes[1].updates)
        trajectories = backend.generate(_requests(8))
        assert {t.policy_version for t in trajectories} == {2}
        resync = fakes[1].updates[before:]
        assert [u["weight_version"] for u in resync] == ["2"]
        assert Path(resync[0]["model_path"]).name == "v00000002-full"
    finally:
        backend.close()


def test_unreachable_server_hands_its_groups_to_another(plugins, model_dir, fakes, tmp_path):
    backend = _backend(plugins, model_dir, fakes, tmp_path)
    try:
        fakes[0].close()
        trajectories = backend.generate(_requests(8))
        assert len(trajectories) == 32 and len(fakes[1].generated_rids) == 32
        assert not backend.health()["ok"]
    finally:
        backend.close()


def test_every_server_down_mid_batch_is_rollout_unavailable(plugins, model_dir, fakes, tmp_path):
    """The overlapped driver turns this into WorkerLost: prompts re-queued, worker restarted and resynced."""
    from rlctl.contracts.errors import RolloutUnavailable

    backend = _backend(plugins, model_dir, fakes, tmp_path, reconnect_timeout_s=1.0)  # not the 120 s default
    try:
        backend.update_weights(_update(1))
        for server in fakes:
            server.close()
        with pytest.raises(RolloutUnavailable, match="no rollout server"):
            backend.generate(_requests(4))
    finally:
        backend.close()


def test_update_that_is_never_confirmed_fails_naming_the_server(plugins, model_dir, tmp_path):
    good, bad = FakeSGLang(), FakeSGLang()
    try:
        backend = _backend(plugins, model_dir, [good], tmp_path)
        bad.refuse_updates = True
        with pytest.raises(RoleError, match="weight version 0 on " + bad.url):
            _backend(plugins, model_dir, [good, bad], tmp_path / "b")
        backend.close()
    finally:
        good.close()
        bad.close()


def test_a_hung_server_is_an_error_within_the_timeout_bound(plugins, model_dir, fakes, tmp_path):
    import time

    backend = _backend(plugins, model_dir, fakes[:1], tmp_path, timeout_s=0.5, retries=1)
    try:
        fakes[0].hang_s = 30.0
        started = time.monotonic()
        with pytest.raises(RoleError, match="weight version 1 on " + fakes[0].url + " not confirmed after 2 tries"):
            backend.update_weights(_update(1))
        assert time.monotonic() - started < 2 * 0.5 + 0.01 + 2.0  # two timed-out tries and one backoff
    finally:
        fakes[0].hang_s = 0.0
        backend.close()


def test_real_sglang_refuses_what_it_cannot_do(plugins, model_dir, fakes, tmp_path):
    with pytest.raises(RoleError, match="delta and fp8 publishes need `rlctl serve rollout`"):
        _backend(plugins, model_dir, fakes, tmp_path, delta=True)
    backend = _backend(plugins, model_dir, fakes, tmp_path)
    try:
        truncated = SamplingConfig(max_tokens=8, top_p=0.9)
        with pytest.raises(RoleError, match="before top-k/top-p truncation"):
            backend.generate(_requests(2, truncated))
    finally:
        backend.close()


def test_the_api_key_from_the_environment_is_sent_on_every_call(plugins, model_dir, tmp_path, monkeypatch):
    server = FakeSGLang(api_key="k3y")
    try:
        monkeypatch.delenv("RLCTL_SERVE_API_KEY", raising=False)
        with pytest.raises(RoleError, match="401"):
            _backend(plugins, model_dir, [server], tmp_path)
        monkeypatch.setenv("RLCTL_SERVE_API_KEY", "k3y")
        refused = server.unauthorized
        backend = _backend(plugins, model_dir, [server], tmp_path / "b")
        try:
            assert backend.generate(_requests(2, SamplingConfig(max_tokens=4)))
            assert server.unauthorized == refused and server.updates  # synced, generated, all with the key
        finally:
            backend.close()
    finally:
        server.close()


# -- the served schema -------------------------------------------------------------------


def test_sampling_params_follow_sglang_rules():
    sampling, n, no_trim, no_eos = parse_sampling({"max_new_tokens": 4, "temperature": 0.7, "top_k": -1,
                                                   "stop": "\n"}, LIMITS)
    assert sampling == SamplingConfig(temperature=0.7, top_p=1.0, top_k=0, max_tokens=4, stop=("\n",))
    assert (n, no_trim, no_eos) == (1, False, False)
    assert parse_sampling({"ignore_eos": True}, dataclasses.replace(LIMITS, ignore_eos=True))[3]
    with pytest.raises(ApiError, match="ignore_eos=true is not supported by this server's rollout backend"):
        parse_sampling({"ignore_eos": True}, LIMITS)  # a backend whose generate takes no ignore_eos
    assert parse_sampling({"temperature": 0.0}, LIMITS)[0].greedy
    for bad, needle in [({"max_tokens": 4}, "unknown field `max_tokens`"), ({"top_k": 0}, "top_k must be -1"),
                        ({"repetition_penalty": 1.1}, "not supported"), ({"temperature": "hot"}, "temperature must be a number")]:
        with pytest.raises(ApiError, match=needle):
            parse_sampling(bad, LIMITS)


def test_generate_body_forms():
    rid = iter(range(100))
    call = parse_generate({"input_ids": [1, 2, 3], "sampling_params": {"n": 2}}, None, lambda: f"r{next(rid)}",
                          LIMITS)
    assert not call.single and [r.rid for r in call.rows] == ["r0-0", "r0-1"]
    call = parse_generate({"input_ids": [[1], [2]], "return_logprob": [True, False], "rid": ["a", "b"]}, None,
                          lambda: "x", LIMITS)
    assert [(r.input_ids, r.return_logprob, r.rid) for r in call.rows] == [((1,), True, "a"), ((2,), False, "b")]
    assert parse_generate({"text": "hi"}, lambda t: [7, 8], lambda: "x", LIMITS).rows[0].input_ids == (7, 8)
    for body, needle in [({}, "exactly one"), ({"input_ids": [[1]], "stream": True}, "stream"),
                         ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "1 entries for 2"),
                         ({"input_ids": [[1]], "logprob_start_len": 0}, "output-token logprobs")]:
        with pytest.raises(ApiError, match=needle):
            parse_generate(body, None, lambda: "x", LIMITS)
