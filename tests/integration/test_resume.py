"""Kill, corrupt, interrupt and resume real ``rlctl train`` processes (deterministic CPU mode).

Every test compares against one uninterrupted 20-step run with the same
training config (checkpoint settings do not change what a step computes):
after a resume the final parameters must be bitwise equal, and the per-step
history of the learning metrics in the registry identical, with no step
missing or duplicated. Wall-clock metrics (T_r, T_l, tokens/s, latencies)
differ between any two runs and are not compared; LEARNING lists what is.

The train split has 16 prompts and a step takes 4, so an epoch is 4 steps and
every checkpoint taken every 4 steps sits exactly on an epoch boundary.
Each SIGKILL of the commit protocol is also exercised, boundary by boundary,
in tests/unit/test_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlctl.storage.step_lines import complete_lines
from tests.conftest import TINY_OVERRIDES
from tests.integration.test_cli import REPO, rlctl

pytestmark = pytest.mark.slow

LEARNING = ("reward_mean", "reward_std", "loss", "grad_norm", "entropy", "kl_ref", "clip_fraction",
            "response_length_mean", "policy_version", "lr", "logprob_mismatch_max")
DET = [*TINY_OVERRIDES, "train.deterministic=true", "algo.kl.coef=0.05", "train.optim.lr=1e-3", "eval.at_end=false",
       "task.options.num_train=16", "train.steps=20"]


@pytest.fixture(scope="module")
def home(tmp_path_factory, _rlctl_home: Path) -> Path:
    path = tmp_path_factory.mktemp("resume_home")
    if (_rlctl_home / "cache").exists():
        (path / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    return path


@pytest.fixture(scope="module")
def straight(home, tmp_path_factory) -> Path:
    """The uninterrupted reference: 20 steps, a checkpoint every 5."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    train(home, run_dir, "checkpoint.every_steps=5")
    return run_dir


def train(home: Path, run_dir: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    return rlctl("train", "configs/quickstart.yaml", *DET, *overrides, "--run-dir", str(run_dir), "--json",
                 home=home, check=check)


def spawn(home: Path, run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    full = dict(os.environ, RLCTL_HOME=str(home), OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "rlctl.cli.app", "train", "configs/quickstart.yaml", *DET,
                             *overrides, "--run-dir", str(run_dir)], cwd=REPO, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["run_id"]


def params(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "policy" / "final" / "model.safetensors")


def assert_same_params(a: Path, b: Path) -> None:
    pa, pb = params(a), params(b)
    assert set(pa) == set(pb)
    assert all((pa[k] == pb[k]).all() for k in pa), "final parameters are not bitwise equal"


def registry(home: Path):
    from rlctl.registry.store import Registry

    return Registry.open(f"sqlite:///{home / 'registry.db'}")


def history(home: Path, run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    with registry(home) as reg:
        points = reg.metrics(run_id(run_dir), names=LEARNING)
    out: dict[str, list[tuple[int, float]]] = {}
    for p in points:
        out.setdefault(p.name, []).append((p.step, p.value))
    return out


def assert_same_history(home: Path, a: Path, b: Path, steps: int) -> None:
    ha, hb = history(home, a), history(home, b)
    assert set(ha) == set(LEARNING)
    for name in LEARNING:
        assert [s for s, _ in hb[name]] == list(range(steps)), name  # every step exactly once
        assert ha[name] == hb[name], name


def assert_index_matches_disk(home: Path, run_dir: Path) -> None:
    from rlctl.engine.checkpoint import COMMITTED

    root = run_dir / "checkpoints"
    dirs = sorted(p.name for p in root.glob("step-*"))
    assert all((root / d / COMMITTED).is_file() for d in dirs), f"partial checkpoint left: {dirs}"
    with registry(home) as reg:
        assert [f"step-{c.step:06d}" for c in reg.checkpoints(run_id(run_dir))] == dirs


def resume(home: Path, run_dir: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    return rlctl("resume", run_id(run_dir), *extra, "--json", home=home, check=check)


def history_of(home: Path, run_dir: Path, name: str) -> list[tuple[int, float]]:
    with registry(home) as reg:
        return [(p.step, p.value) for p in reg.metrics(run_id(run_dir), names=[name])]


def resumed_at(home: Path, run_dir: Path) -> list[int]:
    with registry(home) as reg:
        return [e.data["step"] for e in reg.events(run_id(run_dir)) if e.kind == "resumed"]


# -- SIGKILL at a random point of step 10-11, then `rlctl resume` --------------------------------------


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"train exited early ({proc.returncode}): {proc.stderr.read()}")
        if any(line["step"] >= step for line in complete_lines(path)):  # not a line still being written
            return
        time.sleep(0.005)
    raise AssertionError(f"step {step} not reached in {timeout_s}s")


def test_sigkill_in_step_10_or_11_then_resume_matches_a_straight_run(home, tmp_path, straight):
    step_s = sorted(v for _, v in history_of(home, straight, "step_time_s"))
    seed = random.randrange(10**6)
    delay = random.Random(seed).uniform(0.0, 2 * step_s[len(step_s) // 2])  # somewhere in step 10 or 11

    killed = tmp_path / "killed"
    proc = spawn(home, killed, "checkpoint.every_steps=5")
    wait_for_step(proc, killed, 9)  # step 9 logged: step 10 runs while the step-10 save is in flight
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, f"the run finished before the kill (seed {seed})"

    out = json.loads(resume(home, killed).stdout)
    assert out["run"]["status"] == "succeeded" and out["first_step"] in (5, 10, 15), (out["first_step"], seed)
    assert_same_params(straight, killed)
    assert_same_history(home, straight, killed, 20)
    assert_index_matches_disk(home, killed)
    with registry(home) as reg:
        kinds = [e.kind for e in reg.events(run_id(killed))]
    assert kinds.count("resumed") == 1 and kinds[-1] == "finished"


# The slot scheduler (per-row streams, continuous batching) and packed micro-batches keep the run bitwise
# reproducible: 5 slots split the 4-sample groups across slots, 128-token micro-batches pack several rows.
SLOTS = ("rollout.options.scheduler=slots", "rollout.options.max_batch_sequences=5")
PACKED = ("train.micro_batch_tokens=128",)


@pytest.mark.parametrize("overrides", [SLOTS, PACKED, SLOTS + PACKED], ids=["slots", "packed", "slots-packed"])
def test_sigkill_with_slots_or_packing_then_resume_matches_a_straight_run(home, tmp_path, overrides):
    straight_dir = tmp_path / "straight"
    train(home, straight_dir, "checkpoint.every_steps=5", *overrides)
    killed = tmp_path / "killed"
    proc = spawn(home, killed, "checkpoint.every_steps=5", *overrides)
    wait_for_step(proc, killed, 11)  # step 10 checkpointed; killed within step 12
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before the kill"
    out = json.loads(resume(home, killed).stdout)
    assert out["run"]["status"] == "succeeded" and out["first_step"] in (10, 15), out["first_step"]
    assert_same_params(straight_dir, killed)
    assert_same_history(home, straight_dir, killed, 20)


# -- SIGKILL at the write boundaries of the commit protocol, then corruption ----------------------------

CHAIN = ("checkpoint.every_steps=4", "checkpoint.keep_last=1")
# (RLCTL_CRASH_AT for this process, the step its resume starts from). Saves happen at steps 4, 8, 12, 16, 20;
# each process after the first is a resume that is itself killed at the next boundary.
CRASHES = [
    ("ckpt.file_partial:model/model.safetensors@2", None),  # half of a file of the step-8 save
    ("ckpt.manifest_tmp", 4),  # every file of step 8 written, manifest not yet renamed
    ("ckpt.renamed", 4),  # step 8 committed, directory not yet fsynced
    ("ckpt.dir_synced", 8),  # step 12 committed, no registry row yet
    ("ckpt.registry_row", 12),  # step 16 committed and indexed, retention not yet run
    ("ckpt.retention_unlinked:step-000008", 16),  # step 20 committed; step 8 half deleted (manifest gone)
]


def test_sigkill_at_each_commit_boundary_then_corruption_always_resumes_from_the_last_committed(
        home, tmp_path, straight):
    run_dir = tmp_path / "run"
    for i, (crash_at, _) in enumerate(CRASHES):
        env = dict(os.environ, RLCTL_HOME=str(home), OMP_NUM_THREADS="1", RLCTL_CRASH_AT=crash_at)
        args = (["train", "configs/quickstart.yaml", *DET, *CHAIN, "--run-dir", str(run_dir)] if i == 0
                else ["resume", run_id(run_dir)])
        proc = subprocess.run([sys.executable, "-m", "rlctl.cli.app", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == -signal.SIGKILL, (crash_at, proc.stderr)
    out = json.loads(resume(home, run_dir).stdout)  # step 20 is committed: nothing left but to finish
    assert out["first_step"] == 20 and out["run"]["status"] == "succeeded"
    assert resumed_at(home, run_dir) == [step for _, step in CRASHES[1:]] + [20]
    assert_same_params(straight, run_dir)
    assert_same_history(home, straight, run_dir, 20)
    assert_index_matches_disk(home, run_dir)

    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000012", "step-000016", "step-000020"]
    _flip(root / "step-000020" / "optimizer.safetensors")
    proc = resume(home, run_dir)
    assert json.loads(proc.stdout)["first_step"] == 16
    warning = [line for line in proc.stderr.splitlines() if "warning" in line and "step-000020" in line]
    assert warning and "optimizer.safetensors" in warning[0], proc.stderr
    assert_same_params(straight, run_dir)
    assert_same_history(home, straight, run_dir, 20)
    assert_index_matches_disk(home, run_dir)

    model = root / "step-000020" / "model" / "model.safetensors"  # the only one left after keep_last=1
    model.write_bytes(model.read_bytes()[:1000])
    proc = resume(home, run_dir, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "exist but none verifies" in proc.stderr and "model/model.safetensors" in proc.stderr
    assert "refusing to restart at step 0" in proc.stderr
    assert [s for s, _ in history_of(home, run_dir, "loss")] == list(range(20)), "nothing was re-run"


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40
    path.write_bytes(bytes(data))


# -- epoch boundary, export, refused and allowed changes --------------------------------------------------


def test_resume_at_the_end_of_an_epoch_trains_the_remaining_steps_and_exports(home, tmp_path, straight):
    run_dir = tmp_path / "run"
    train(home, run_dir, "train.steps=8", "checkpoint.every_steps=4")
    state = json.loads((run_dir / "checkpoints" / "step-000008" / "state.json").read_text())
    assert state["cursor"] == {"epoch": 2, "position": 0}, "the run stopped exactly at an epoch boundary"
    proc = rlctl("train", "--resume", run_id(run_dir), "train.steps=20", "--json", home=home, check=True)
    warnings = [line for line in proc.stderr.splitlines()
                if "warning" in line and "ALERT" not in line]  # live metric alerts on the tiny model are fine
    assert json.loads(proc.stdout)["first_step"] == 8 and not warnings
    assert_same_params(straight, run_dir)
    assert_same_history(home, straight, run_dir, 20)

    hf = tmp_path / "hf"
    out = json.loads(rlctl("export", run_id(run_dir), "--hf", str(hf), "--json", home=home, check=True).stdout)
    assert out["checkpoint"].endswith("step-000020")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf, local_files_only=True)
    assert AutoTokenizer.from_pretrained(hf, local_files_only=True)("1+1=")["input_ids"]
    final = params(run_dir)
    assert all((model.state_dict()[k] == final[k]).all() for k in final)


def test_changed_dataset_or_config_is_refused_with_what_changed(home, tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    files = {}
    for split, part in (("train", rows[:15]), ("dev", rows[15:20]), ("hidden", rows[20:])):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in part))
    task = ["task.source=jsonl", "task.options={" + ", ".join(f"{k}: {v}" for k, v in files.items()) + "}"]
    run_dir = tmp_path / "run"
    train(home, run_dir, *task, "train.steps=2", "checkpoint.every_steps=2")

    proc = resume(home, run_dir, "train.steps=4", "algo.group_size=8", check=False)
    assert proc.returncode == 1 and "algo.group_size: 4 -> 8" in proc.stderr and "--allow-config-change" in proc.stderr

    with files["train"].open("a") as fh:
        fh.write(json.dumps({"prompt": "9+9=", "answer": "18"}) + "\n")
    proc = resume(home, run_dir, "train.steps=4", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "the dataset changed since checkpoint step 2" in proc.stderr, proc.stderr

    proc = resume(home, run_dir, "train.steps=4", "--allow-config-change")
    assert json.loads(proc.stdout)["run"]["status"] == "succeeded"
    assert "warning" in proc.stderr and "dataset changed" in proc.stderr


# -- SIGTERM -------------------------------------------------------------------------------------------------


def test_sigterm_marks_the_run_interrupted_and_resumable(home, tmp_path, straight):
    run_dir = tmp_path / "run"
    proc = spawn(home, run_dir, "checkpoint.every_steps=3")
    wait_for_step(proc, run_dir, 4)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert f"rlctl resume {run_id(run_dir)}" in err
    with registry(home) as reg:
        run = reg.get_run(run_id(run_dir))
        event = [e for e in reg.events(run.id) if e.kind == "interrupted"][-1]
    assert run.status == "interrupted" and event.data["resumable"] is True
    assert event.data["checkpoint_step"] >= 3 and "rlctl resume" in event.message
    assert_index_matches_disk(home, run_dir)
    out = json.loads(resume(home, run_dir).stdout)
    assert out["run"]["status"] == "succeeded" and out["first_step"] >= 3
    assert_same_params(straight, run_dir)


# -- the chat template and the tokenizer are part of the dataset version --------------------------------------


def test_a_changed_chat_template_or_tokenizer_is_a_new_dataset_and_resume_refuses_it(home, tmp_path):
    from tests.unit.test_task_formats import save_tokenizer

    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
            for a in range(5) for b in range(5)]
    files = {}
    for split, part in (("train", rows[:15]), ("dev", rows[15:20]), ("hidden", rows[20:])):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in part))
    tok = tmp_path / "tok"
    save_tokenizer(tok, template=template)
    task = ["task.source=jsonl", "task.options={" + ", ".join(f"{k}: {v}" for k, v in files.items())
            + f", messages_key: messages, tokenizer: {tok}}}"]
    run_dir = tmp_path / "run"
    train(home, run_dir, *task, "train.steps=2", "checkpoint.every_steps=2")

    save_tokenizer(tok, template=template.replace("[assistant]", "[bot]"))  # same files, another template
    proc = resume(home, run_dir, "train.steps=4", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "the dataset changed since checkpoint step 2" in proc.stderr, proc.stderr

    save_tokenizer(tok, template=template, extra_token="<tool>")  # the same template, another tokenizer
    proc = rlctl("train", "--resume", run_id(run_dir), "train.steps=4", home=home)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "the dataset changed since checkpoint step 2" in proc.stderr, proc.stderr

    save_tokenizer(tok, template=template)  # back to what the run trained on: the resume goes through
    proc = resume(home, run_dir, "train.steps=4")
    assert json.loads(proc.stdout)["run"]["status"] == "succeeded"
