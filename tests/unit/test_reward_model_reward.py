"""The "reward_model" reward against real `rlctl serve reward` servers (in-process) and scripted far ends.

A failure of the reward-model service is flagged (error_code), never a score
of 0: retried with back-off on the next server, then "grader_error:..." or
"timeout:..." (the engine re-scores those with a fresh grader, then drops the
group). The grader version carries the served model's hash, so the dataset
version does too. The scripted servers (``ScriptedServer``) stand in only for
far ends that misbehave in ways a real server does not on demand (503s, hangs,
a swapped model).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlctl.contracts.errors import ConfigError, RoleError
from rlctl.contracts.types import SamplingConfig, TerminalReason, Trajectory
from rlctl.placement.ranks import free_port
from rlctl.serve.http_common import HttpOptions
from rlctl.serve.reward import RewardServer, build_reward_service

FAST = {"retries": 2, "backoff_s": 0.01, "backoff_max_s": 0.02, "timeout_s": 5.0}


class LiveRM:
    def __init__(self, model_dir: Path, api_key: str | None = None) -> None:
        self.service = build_reward_service(model_dir, max_wait_s=0.001)
        self.server = RewardServer(self.service, "127.0.0.1", 0, http=HttpOptions(api_key=api_key))
        self.url = self.server.url
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join(10)


class ScriptedServer:
    """A far end answering from a script: ``script(path, calls) -> (status, payload)``; counts /score calls."""

    def __init__(self, script) -> None:
        self.calls = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                if self.path == "/score":
                    outer.calls += 1
                status, payload = script(self.path, outer.calls)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _reply

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def info_then(score):
    """A script: /info reports model_hash "h"; /score answers ``score(calls)``."""
    return lambda path, calls: (200, {"model_hash": "h"}) if path == "/info" else score(calls)


def traj(prompt: str = "3+4=", response: str = "7") -> Trajectory:
    from rlctl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    return Trajectory.create(id="p/0", prompt_id="p", group_index=0, dataset_version="d", policy_version=0,
                             tokenizer_hash="t", prompt_tokens=tuple(tok(prompt)["input_ids"]), response_tokens=(5,),
                             response_text=response, action_mask=(1,), behavior_logprobs=(-0.5,),
                             sampling_config=SamplingConfig(max_tokens=4), terminal_reason=TerminalReason.EOS,
                             rollout_started_at=0.0)


def build(plugins, servers, **options):
    return plugins.build("reward_function", "reward_model", {"servers": servers, **FAST, **options}, "test")


@pytest.fixture(scope="module")
def rm(tiny_reward_model_dir):
    server = LiveRM(tiny_reward_model_dir)
    yield server
    server.stop()


def test_scores_come_from_the_model_and_the_version_names_its_hash(plugins, rm):
    reward = build(plugins, [rm.url])
    result = reward.score(traj(), "7")
    _, direct = rm.service.score({"prompt": "3+4=", "response": "7"})  # the prompt tokens decode to "3+4="
    assert result.ok and result.total == pytest.approx(direct["scores"][0], abs=1e-6)
    assert result.components == {"reward_model": result.total}
    assert reward.version == f"reward_model@1.0+{rm.service.model_hash}"


def test_the_mix_records_each_component_and_names_the_model_in_its_version(plugins, rm):
    from rlctl.engine.reward_mix import MixedReward

    model = build(plugins, [rm.url])
    mix = MixedReward([("reward_model", 0.5, model), ("math", 1.0, plugins.build("reward_function", "math", {}, "t"))])
    result = mix.score(traj(response="7"), "7")
    assert result.ok and set(result.components) == {"reward_model", "math"}
    assert result.total == pytest.approx(0.5 * result.components["reward_model"] + 1.0)
    assert rm.service.model_hash in mix.version and mix.version.startswith("reward_model:reward_model@1.0+")


def test_another_reward_model_is_another_grader_and_dataset_version(plugins, rm, tmp_path):
    from rlctl.config.load import load_config
    from rlctl.placement.build import load_task
    from rlctl.models.reward_model import build_tiny_reward_model

    other = LiveRM(build_tiny_reward_model(tmp_path / "rm1", seed=1))
    try:
        assert other.service.model_hash != rm.service.model_hash
        versions = []
        for url in (rm.url, other.url):
            config = load_config(None, [f"reward.components=[{{name: reward_model, options: {{servers: [{url}]}}}}, "
                                        "{name: math}]", "task.options.num_train=20"])
            versions.append(load_task(config, plugins).version)
        assert versions[0] != versions[1]
    finally:
        other.stop()


def test_a_dead_server_is_retried_on_the_next_one(plugins, rm):
    dead = f"http://127.0.0.1:{free_port()}"
    reward = build(plugins, [dead, rm.url])  # startup skips the dead one: the live one names the model
    logs = [reward.score(traj(), "7") for _ in range(4)]
    assert all(r.ok for r in logs)
    assert sum("after 1 retry" in r.log for r in logs) == 2  # round robin: every other sample starts on the dead one


def test_503s_are_retried_with_backoff_until_one_answers(plugins):
    server = ScriptedServer(info_then(lambda calls: (503, {"error": "busy"}) if calls <= 2
                                      else (200, {"scores": [0.25], "model_hash": "h"})))
    try:
        result = build(plugins, [server.url]).score(traj(), "7")
        assert result.ok and result.total == 0.25 and "after 2 retries" in result.log and server.calls == 3
    finally:
        server.stop()


def test_backoff_doubles_up_to_its_cap(plugins):
    server = ScriptedServer(info_then(lambda calls: (200, {"scores": [0.0], "model_hash": "h"})))
    try:
        reward = build(plugins, [server.url], backoff_s=0.1, backoff_max_s=0.5)
        assert [reward._backoff(k) for k in range(1, 6)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    finally:
        server.stop()


def test_a_stopped_server_flags_the_sample_never_zero(plugins, tiny_reward_model_dir):
    from rlctl.engine.scoring import _apply, retryable

    live = LiveRM(tiny_reward_model_dir)
    reward = build(plugins, [live.url])
    assert reward.score(traj(), "7").ok
    live.stop()
    result = reward.score(traj(), "7")
    assert result.error_code == "grader_error:reward_model" and not result.components
    assert "3 attempt(s) failed" in result.log and "Connection refused" in result.log
    assert retryable(result.error_code)  # the engine re-scores it with a fresh grader, then drops the group
    assert _apply(traj(), result, None).reward is None
    fresh = build(plugins, [live.url])  # a fresh grader (engine retry) keeps the run's version while it is down
    assert fresh.version == reward.version and fresh.score(traj(), "7").error_code == "grader_error:reward_model"


def test_a_server_that_does_not_answer_in_time_is_a_timeout(plugins):
    released = threading.Event()

    def hang(calls):
        released.wait(10)  # answers only after the client gave up
        return 200, {"scores": [0.0], "model_hash": "h"}

    server = ScriptedServer(info_then(hang))
    try:
        result = build(plugins, [server.url], timeout_s=0.2, retries=1).score(traj(), "7")
        assert result.error_code == "timeout:reward_model" and "timed out" in result.log and server.calls == 2
    finally:
        released.set()
        server.stop()


@pytest.mark.parametrize("script, code, calls", [
    (lambda calls: (400, {"error": "prompt + response is 900 tokens; the reward model has 256 positions"}),
     "reward_model_refused", 1),
    (lambda calls: (200, {"scores": [None], "model_hash": "h"}), "invalid_reward", 1),
    (lambda calls: (200, {"scores": [1.0], "model_hash": "other"}), "grader_error:reward_model", 3),
    (lambda calls: (200, {"nothing": True}), "grader_error:reward_model", 3),
])
def test_refusals_and_bad_answers_are_flagged(plugins, script, code, calls):
    server = ScriptedServer(info_then(script))
    try:
        result = build(plugins, [server.url]).score(traj(), "7")
        assert result.error_code == code and not result.ok and server.calls == calls, result
    finally:
        server.stop()


def test_startup_errors_name_the_fix(plugins, rm, tiny_reward_model_dir, monkeypatch):
    with pytest.raises(RoleError, match="no reward model server answered") as err:
        build(plugins, [f"http://127.0.0.1:{free_port()}"], retries=0)
    assert "rlctl serve reward" in err.value.hint
    keyed = LiveRM(tiny_reward_model_dir, api_key="s3cret")
    not_rm = ScriptedServer(lambda path, calls: (200, {"model_path": "x"}))
    try:
        monkeypatch.delenv("RLCTL_SERVE_API_KEY", raising=False)
        with pytest.raises(ConfigError, match="401") as err:
            build(plugins, [keyed.url])
        assert "RLCTL_SERVE_API_KEY" in err.value.hint
        monkeypatch.setenv("RM_KEY", "s3cret")
        assert build(plugins, [keyed.url], api_key_env="RM_KEY").score(traj(), "7").ok
        with pytest.raises(ConfigError, match="no model_hash"):
            build(plugins, [not_rm.url])
    finally:
        keyed.stop()
        not_rm.stop()
    other = ScriptedServer(info_then(lambda calls: (200, {"scores": [0.0], "model_hash": "h"})))
    try:
        with pytest.raises(ConfigError, match="different models"):
            build(plugins, [rm.url, other.url])
    finally:
        other.stop()


def test_options_are_validated(plugins):
    from rlctl.contracts.errors import ConfigError as Err

    for bad in ({"servers": []}, {"servers": ["127.0.0.1:1"]}, {"servers": ["http://a:1", "http://a:1/"]},
                {"servers": ["http://a:1"], "retries": -1}, {"servers": ["http://a:1"], "api_key": "x"}):
        with pytest.raises(Err):
            plugins.build("reward_function", "reward_model", bad, "reward.components.0.options")


def test_the_policy_tokenizer_defaults_to_the_policy_model(plugins, tiny_policy_dir):
    from rlctl.config.load import load_config
    from rlctl.placement.build import reward_options

    opts = {"servers": ["http://127.0.0.1:1"]}
    assert reward_options(load_config(None, []), plugins, "reward_model", opts) == opts  # built-in: char tokenizer
    user = load_config(None, [f"model.path={tiny_policy_dir}"])
    assert reward_options(user, plugins, "reward_model", opts)["policy_tokenizer"] == str(tiny_policy_dir)
    assert reward_options(user, plugins, "math", {}) == {}


@pytest.mark.slow  # two spawned grader processes import torch: ~15 s on a busy box
def test_parallel_reward_workers_score_through_the_server_in_input_order(plugins, rm):
    from functools import partial

    from rlctl.engine.reward_mix import MixedReward
    from rlctl.engine.reward_pool import ProcessRewardPool

    reward = build(plugins, [rm.url])
    samples = [traj(f"{k}+{k}=", str(2 * k)) for k in range(6)]
    alone = [reward.score(t, "0").total for t in samples]
    with ProcessRewardPool(partial(MixedReward, [("reward_model", 1.0, reward)]), workers=2, timeout_s=60) as pool:
        pooled = pool.score(samples, ["0"] * len(samples))
    assert all(r.ok for r in pooled) and [r.total for r in pooled] == pytest.approx(alone, abs=1e-5)


# -- batches: the engine grades a step in few requests -------------------------------------------------------


def test_a_step_is_scored_in_batch_size_requests_with_the_same_results(plugins, rm):
    from rlctl.engine.reward_mix import MixedReward
    from rlctl.engine.scoring import score_all

    model = build(plugins, [rm.url], batch_size=4)
    mix = MixedReward([("reward_model", 0.5, model), ("math", 1.0, plugins.build("reward_function", "math", {}, "t"))])
    samples = [traj(f"{k}+1=", str(k + 1) if k % 2 else "0").updated(prompt_id=f"p{k}", id=f"p{k}/0")
               for k in range(10)]
    refs = {f"p{k}": str(k + 1) for k in range(10)}
    one_by_one = [mix.score(t, refs[t.prompt_id]) for t in samples]
    before = rm.service.worker.stats.requests
    scored, latencies = score_all(samples, refs, mix, None)  # in-process: through score_batch
    assert rm.service.worker.stats.requests - before == 3  # 10 samples, 4 per request
    assert [t.reward for t in scored] == pytest.approx([r.total for r in one_by_one], abs=1e-5)
    assert all(t.reward_components.keys() == {"reward_model", "math"} for t in scored)
    assert all(lat > 0 for lat in latencies)


def test_a_refused_batch_flags_only_the_sample_at_fault(plugins, rm):
    reward = build(plugins, [rm.url])
    samples = [traj("1+1=", "2"), traj("1+1=", "2" * 400), traj("2+2=", "4")]  # the middle one is too long
    results = reward.score_batch(samples, ["2", "2", "4"])
    assert [r.error_code for r in results] == [None, "reward_model_refused", None]
    assert "positions" in results[1].log and results[0].total == pytest.approx(reward.score(samples[0], "2").total)


def test_a_batch_call_that_fails_flags_every_sample_in_it_and_spares_the_others(plugins):
    from rlctl.engine.reward_mix import MixedReward

    class Broken:
        name, version = "broken", "broken@1"

        def score(self, trajectory, reference):
            raise AssertionError("score_batch is used")

        def score_batch(self, trajectories, references):
            raise ConnectionError("service gone")

    mix = MixedReward([("math", 1.0, plugins.build("reward_function", "math", {}, "t")), ("rm", 1.0, Broken())])
    results = mix.score_batch([traj(response="7"), traj(response="8")], ["7", "7"])
    assert [r.error_code for r in results] == ["grader_error:rm", "grader_error:rm"]
    assert all("service gone" in r.log and r.components == {"math": r.components["math"]} for r in results)
