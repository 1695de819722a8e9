"""`rlctl serve rollout` in another process, driven through the sglang rollout plugin over HTTP (127.0.0.1 only).

What these check: the SGLang response shape and request batching; behaviour
logprobs from the server == learner logprobs (<= 1e-4, fp32); weight updates
through the disk publisher end with the server's fingerprint equal to the
learner's; corrupt and uncommitted versions are refused while the previous
version keeps serving; a restarted server is resynced before it serves; an
outage pauses the weight sync until the server is back, or fails clearly.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from rlctl.config.load import load_config
from rlctl.contracts.errors import RoleError
from tests.helpers import rollout_batch
from tests.conftest import TINY_OVERRIDES
from tests.integration.test_cli import REPO, rlctl


class Served:
    """One `rlctl serve rollout` subprocess; always stopped by the test that started it."""

    def __init__(self, model_dir: Path, log_dir: Path, port: int = 0, scheduler: str = "auto") -> None:
        self.log = open(log_dir / f"serve-{time.monotonic_ns()}.log", "w+")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlctl.cli.app", "serve", "rollout", "--model", str(model_dir),
             "--host", "127.0.0.1", "--port", str(port), "--batch-wait-ms", "30", "--scheduler", scheduler],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=REPO)
        self.url = self._wait_ready(timeout_s=120)
        self.port = int(self.url.rsplit(":", 1)[1])

    def _wait_ready(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if "listening on" in line:
                    return line.split("listening on ", 1)[1].split()[0]
                if not line and self.proc.poll() is not None:
                    break
        self.stop()
        self.log.seek(0)
        raise AssertionError(f"rlctl serve rollout did not start:\n{self.log.read()[-3000:]}")

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as resp:
            return json.loads(resp.read())

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()


@pytest.fixture(scope="module")
def server(tiny_policy_dir, tmp_path_factory):
    served = Served(tiny_policy_dir, tmp_path_factory.mktemp("serve"))
    yield served
    served.stop()


def _session(plugins, home: Path, url: str, tmp_path: Path, extra=(), **options):
    from tests.helpers import build_roles

    opts = {"servers": [url], "publish_dir": str(tmp_path / "pub"), "retries": 2, "retry_backoff_s": 0.2, **options}
    cfg = load_config(None, [*TINY_OVERRIDES, *extra, "rollout.backend=sglang", f"rollout.options={json.dumps(opts)}"])
    return build_roles(cfg, plugins, home / "cache")


_batch = rollout_batch


def _mismatch(session, batch) -> float:
    learner = session.learner.logprobs(batch)  # [N, T]
    mask = batch.action_mask > 0
    assert int(mask.sum()) > 0
    return float((learner - batch.behavior_logprobs)[mask].abs().max())


@pytest.fixture(scope="module")
def batch_server(tiny_policy_dir, tmp_path_factory):
    served = Served(tiny_policy_dir, tmp_path_factory.mktemp("serve-batch"), scheduler="batch")
    yield served
    served.stop()


@pytest.mark.parametrize("scheduler", ["continuous", "batch"])
def test_generate_speaks_sglang_and_batches_concurrent_requests(request, scheduler):
    """Six concurrent requests share engine work: with the batch scheduler they fit in fewer batches than
    requests (the 30 ms window), with the continuous one (the default here) they decode in the same steps."""
    server = request.getfixturevalue("server" if scheduler == "continuous" else "batch_server")
    before = server.get("/get_server_info")["rlctl"]
    assert before["scheduler"] == scheduler
    results: list[tuple[int, dict]] = []
    body = {"input_ids": [[1, 20, 21], [1, 22, 23, 24]], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 1.0}}
    threads = [threading.Thread(target=lambda: results.append(server.post("/generate", body))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [status for status, _ in results] == [200] * 6
    item = results[0][1][0]
    assert set(item) == {"text", "output_ids", "meta_info"}
    meta = item["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == item["output_ids"]
    assert all(e[0] <= 0 and e[2] is None for e in meta["output_token_logprobs"])
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["prompt_tokens"] == 3
    after = server.get("/get_server_info")["rlctl"]
    assert after["requests"] - before["requests"] == 6
    assert after["largest_batch_requests"] >= 2
    if scheduler == "batch":
        assert after["batches"] - before["batches"] < 6
    else:  # decode steps: fewer than 6 requests x 5 tokens one after the other
        assert after["batches"] - before["batches"] < 30
    status, error = server.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_tokens": 3}})
    assert status == 400 and "unknown field `max_tokens`" in error["error"]["message"]


@pytest.mark.parametrize("sampling", [
    [],
    ["rollout.temperature=0.7", "rollout.top_k=8", "rollout.top_p=0.9"],
])
def test_served_behaviour_logprobs_match_the_learner(plugins, _rlctl_home, tiny_policy_dir, server, tmp_path,
                                                      sampling):
    session = _session(plugins, _rlctl_home, server.url, tmp_path, sampling)
    try:
        trajectories, batch = _batch(session)
        assert all(t.verify() and t.policy_version == 0 for t in trajectories)
        assert _mismatch(session, batch) <= 1e-4
    finally:
        session.rollout.close()


def test_episodes_over_the_served_engine_keep_the_sampled_ids_masks_and_logprobs(plugins, _rlctl_home,
                                                                                tiny_policy_dir, server, tmp_path):
    """The episode driver over the sglang plugin: each later turn is a token-id request (prompt + every turn so
    far). The server keeps the stop string in ``output_ids`` (``no_stop_trim``), so a policy turn ends with the
    token the engine sampled; environment tokens are masked; the learner matches the engine on policy tokens."""
    from rlctl.contracts.types import Writer
    from rlctl.engine.batching import build_batch
    from rlctl.engine.episodes import EpisodeDriver
    from tests.unit.test_episodes import EchoEnv, _check_structure, _requests

    session = _session(plugins, _rlctl_home, server.url, tmp_path)
    env = EchoEnv(session.tokenizer, obs="; ")
    try:
        out = EpisodeDriver(session.rollout, env, session.tokenizer).generate(_requests(session))
    finally:
        session.rollout.close()
    stops = {session.tokenizer.convert_tokens_to_ids(c) for c in env.stop}
    policy = [(t, x) for t in out for x in t.turns if x.writer is Writer.POLICY]
    for t in out:
        _check_structure(t, env)
    ended_at_stop = [t.response_tokens[x.end - 1] for t, x in policy if t.response_tokens[x.end - 1] in stops]
    assert ended_at_stop and max(sum(x.writer is Writer.ENV for x in t.turns) for t in out) >= 2  # multi-turn
    batch = build_batch(out, [0.0] * len(out), session.tokenizer.pad_token_id, session.sampling)
    worst = _mismatch(session, batch)
    print(f"\nsglang episodes: {sum(sum(x.writer is Writer.ENV for x in t.turns) >= 2 for t in out)}/{len(out)} "
          f"with >= 2 environment turns, {len(ended_at_stop)} policy turns ended at a stop string, max |learner - "
          f"behaviour logprob| on policy tokens: {worst:.2e}")
    assert worst <= 1e-4


@pytest.mark.parametrize("delta", [False, True])
def test_weight_update_through_disk_matches_the_learner(plugins, _rlctl_home, tiny_policy_dir, server, tmp_path,
                                                        delta):
    session = _session(plugins, _rlctl_home, server.url, tmp_path, ["train.optim.lr=1e-3"], delta=delta)
    try:
        for version in (1, 2):
            _, batch = _batch(session, advantages=[1.0, -1.0] * 8)
            session.learner.train_step(batch)
            update = session.learner.export_weights()
            session.rollout.update_weights(update)
            info = server.get("/get_model_info")
            assert info["weight_version"] == str(version) and info["rlctl"]["fingerprint"] == update.fingerprint
            assert session.rollout.last_publish.delta == (delta and version == 2)
            trajectories, batch = _batch(session)
            assert {t.policy_version for t in trajectories} == {version}
            assert _mismatch(session, batch) <= 1e-4
    finally:
        session.rollout.close()


def test_corrupt_or_uncommitted_versions_are_refused_and_the_old_one_keeps_serving(plugins, _rlctl_home,
                                                                                   tiny_policy_dir, server,
                                                                                   tmp_path):
    import shutil

    from rlctl.engine.transports.disk import DiskTransport
    from rlctl.engine.weight_sync import Broadcaster

    session = _session(plugins, _rlctl_home, server.url, tmp_path)
    try:
        serving = server.get("/get_model_info")
        report = Broadcaster(DiskTransport(tmp_path / "other")).publish(session.learner.export_weights())
        partial = tmp_path / "other" / "v00000007-full"
        shutil.copytree(report.location, partial)
        (partial / "manifest.json").unlink()
        status, answer = server.post("/update_weights_from_disk", {"model_path": str(partial), "weight_version": "7"})
        assert status == 400 and not answer["success"] and "no committed weight version" in answer["message"]
        shard = Path(report.location) / report.manifest.shards[0].path
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0xFF
        shard.write_bytes(bytes(data))
        status, answer = server.post("/update_weights_from_disk", {"model_path": report.location,
                                                                   "weight_version": "8"})
        assert status == 400 and shard.name in answer["message"] and "sha256" in answer["message"]
        assert server.get("/get_model_info") == serving
    finally:
        session.rollout.close()


@pytest.mark.parametrize("encoding", ["raw", "bf16"])
def test_a_full_published_version_is_a_plain_model_directory(plugins, _rlctl_home, tiny_policy_dir, tmp_path,
                                                             encoding):
    """What SGLang's update_weights_from_disk loads: checked with transformers (SGLang itself is not run)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlctl.contracts.types import WeightUpdate
    from rlctl.engine.transports.disk import DiskTransport
    from rlctl.engine.weight_sync import Broadcaster, SyncOptions
    from rlctl.models.fingerprint import fingerprint

    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, local_files_only=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    transport = DiskTransport(tmp_path, extra_files=[Path(tiny_policy_dir) / "config.json"])
    report = Broadcaster(transport, SyncOptions(encoding=encoding, bucket_bytes=16 << 10)).publish(
        WeightUpdate(version=1, state_dict=state, fingerprint=fingerprint(state)))
    assert report.num_shards > 1
    loaded = AutoModelForCausalLM.from_pretrained(report.location, local_files_only=True, dtype=torch.float32)
    tolerance = 0.0 if encoding == "raw" else 2.0 ** -8
    for name, value in loaded.state_dict().items():
        assert bool(((value - state[name]).abs() <= state[name].abs() * tolerance).all()), name


def test_restarted_server_is_resynced_before_it_serves(plugins, _rlctl_home, tiny_policy_dir, tmp_path):
    served = Served(tiny_policy_dir, tmp_path)
    try:
        session = _session(plugins, _rlctl_home, served.url, tmp_path, ["train.optim.lr=1e-3"], delta=True)
        for _ in range(2):  # version 2 goes out as a delta against version 1
            _, batch = _batch(session, advantages=[1.0, -1.0] * 8)
            session.learner.train_step(batch)
            update = session.learner.export_weights()
            session.rollout.update_weights(update)
        assert session.rollout.last_publish.delta
        served.stop()
        served = Served(tiny_policy_dir, tmp_path, port=served.port)  # comes back with its start weights
        assert served.get("/get_model_info")["weight_version"] == "default"
        trajectories, batch = _batch(session)  # the delta cannot apply there: a full copy is published and sent
        assert {t.policy_version for t in trajectories} == {2}
        assert not session.rollout.last_publish.delta and session.rollout.last_publish.version == 2
        assert served.get("/get_model_info")["rlctl"]["fingerprint"] == update.fingerprint
        assert _mismatch(session, batch) <= 1e-4
        session.rollout.close()
    finally:
        served.stop()


def test_weight_sync_waits_for_a_server_outage_and_fails_clearly_past_the_bound(plugins, _rlctl_home,
                                                                                 tiny_policy_dir, tmp_path):
    served = Served(tiny_policy_dir, tmp_path)
    box: dict[str, Served] = {}
    try:
        # Enough tries to outlast a restart on a loaded machine (the bound itself is checked below).
        session = _session(plugins, _rlctl_home, served.url, tmp_path, ["train.optim.lr=1e-3"], retries=8,
                           retry_backoff_s=0.5)
        _, batch = _batch(session, advantages=[1.0, -1.0] * 8)
        session.learner.train_step(batch)
        port = served.port
        served.stop()
        restarter = threading.Timer(1.0, lambda: box.setdefault("s", Served(tiny_policy_dir, tmp_path, port=port)))
        restarter.start()
        started = time.monotonic()
        update = session.learner.export_weights()
        session.rollout.update_weights(update)  # blocks (the learner is paused) until the server confirms
        restarter.join()
        served = box["s"]
        assert time.monotonic() - started > 1.0
        assert served.get("/get_model_info")["rlctl"]["fingerprint"] == update.fingerprint

        session.rollout.options.retries = 1  # now an outage that outlasts the bound
        served.stop()
        session.learner.train_step(batch)
        started = time.monotonic()
        with pytest.raises(RoleError, match=rf"weight version 2 on {served.url} not confirmed after 2 tries"):
            session.rollout.update_weights(session.learner.export_weights())
        assert time.monotonic() - started < 10
        session.rollout.close()
    finally:
        served.stop()
        restarter.join() if "restarter" in locals() else None
        if "s" in box:  # the restarted server, also when the test failed before taking it over
            box["s"].stop()


@pytest.mark.slow
def test_quickstart_trains_end_to_end_against_a_served_engine(server, tmp_path, _rlctl_home):
    home = tmp_path
    if (_rlctl_home / "cache").exists():
        (home / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    options = json.dumps({"servers": [server.url], "publish_dir": str(tmp_path / "pub")})
    proc = rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "rollout.backend=sglang",
                 f"rollout.options={options}", "--json", home=home, check=True)
    out = json.loads(proc.stdout)
    assert out["run"]["status"] == "succeeded"
    assert out["last_metrics"]["logprob_mismatch_max"] <= 1e-4
    assert out["eval"]["num_prompts"] == 20
    info = server.get("/get_model_info")  # eval loaded the final policy last
    assert info["weight_version"] == "0"


def _cpus_allowed(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


def test_launched_servers_are_pinned_restarted_resynced_and_stopped(plugins, _rlctl_home, tiny_policy_dir, tmp_path):
    """The sglang plugin's launch block with `rlctl serve rollout` as the launched command: the same EngineServers
    as the vllm plugin's (pinning, logs, restart of a SIGKILLed server and resync before it serves, stop on close)."""
    import signal

    cpu = min(os.sched_getaffinity(0))
    launch = {"command": [sys.executable, "-m", "rlctl.cli.app", "serve", "rollout", "--model", "{model}",
                          "--port", "{port}"],
              "cpus": [str(cpu)], "port_range": [18700, 18799], "log_dir": str(tmp_path / "engines"),
              "startup_timeout_s": 120}
    session = _session(plugins, _rlctl_home, "", tmp_path, ["train.optim.lr=1e-3"], servers=None, launch=launch)
    engines = session.rollout.engines
    try:
        (pid,) = engines.pids()
        assert _cpus_allowed(pid) == str(cpu)
        assert "serve rollout" in (tmp_path / "engines" / "server-0.log").read_text().splitlines()[0]
        _, batch = _batch(session, advantages=[1.0, -1.0] * 8)
        session.learner.train_step(batch)
        update = session.learner.export_weights()
        session.rollout.update_weights(update)
        os.killpg(pid, signal.SIGKILL)
        engines.procs[0].wait(timeout=30)
        trajectories, batch = _batch(session)  # restarted on its port, resynced to version 1 before it serves
        (new_pid,) = engines.pids()
        assert new_pid != pid and _cpus_allowed(new_pid) == str(cpu)
        assert {t.policy_version for t in trajectories} == {1}
        assert _mismatch(session, batch) <= 1e-4
    finally:
        session.rollout.close()
    assert not engines.alive(0)
    with pytest.raises(ProcessLookupError):
        os.killpg(new_pid, 0)


@pytest.mark.parametrize("scheduler", ["continuous", "batch"])
def test_ignore_eos_runs_rows_to_max_new_tokens(request, scheduler):
    server = request.getfixturevalue("server" if scheduler == "continuous" else "batch_server")
    body = {"input_ids": [[1, 20, 21]] * 3, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    status, items = server.post("/generate", body)
    assert status == 200 and [len(item["output_ids"]) for item in items] == [40, 40, 40]
    assert all(item["meta_info"]["finish_reason"]["type"] == "length" for item in items)
