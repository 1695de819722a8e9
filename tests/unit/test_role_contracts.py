"""Role contracts: what core calls on a role is on its Protocol, and a Protocol-only backend runs.

- third-party roles that implement only their Protocols (no rlctl base class,
  no checkpoint support): a learner trains two steps end to end through
  ``train()`` with the default roles, and a task source, rollout backend,
  reward function, learner and metric sink, all minimal, run two steps together;
- every attribute core touches on the learner and the rollout backend during a
  train (checkpoints and KL-in-reward on), a resume and a dry-run smoke step is
  declared on a Protocol: the roles are wrapped in a recorder that forwards only
  the Protocols' members and records every other name core asks for, so a method
  removed from a Protocol (or a new call core makes outside it) fails here;
- core never compares a configured backend name against a plugin's name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import pytest
import torch

from rlctl import WeightUpdate, hookimpl
from rlctl.contracts.roles import (
    CancellableRollout,
    CapturingLearner,
    CheckpointableLearner,
    ClosableLearner,
    LearnerBackend,
    LrScalable,
    ReadableWeights,
    RestartableLearner,
    RolloutBackend,
    RunDirAware,
    ShardedCheckpointLearner,
    StatefulRollout,
)
from tests.conftest import TINY_OVERRIDES

REPO = Path(__file__).resolve().parents[2]


def protocol_members(*protocols: type) -> set[str]:
    names: set[str] = set()
    for proto in protocols:
        for klass in proto.__mro__:
            if klass in (object,) or klass.__name__ in ("Protocol", "Generic"):
                continue
            names |= {n for n in vars(klass) if not n.startswith("_")}
            names |= {n for n in getattr(klass, "__annotations__", {}) if not n.startswith("_")}
    return names


LEARNER_MEMBERS = protocol_members(LearnerBackend, CheckpointableLearner, ShardedCheckpointLearner,
                                   ClosableLearner, CapturingLearner, RestartableLearner, LrScalable)
ROLLOUT_MEMBERS = protocol_members(RolloutBackend, StatefulRollout, CancellableRollout, ReadableWeights,
                                   RunDirAware)


class MinimalLearner:
    """A third-party learner: only LearnerBackend's members; REINFORCE with the batch's advantages."""

    def __init__(self, ctx: Any) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(ctx.model_dir, local_files_only=True)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.policy_version = 0

    def _logp(self, batch: Any) -> torch.Tensor:
        ids, mask = batch.input_ids, batch.attention_mask  # [N, T]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]  # [N, T-1]
        return torch.nn.functional.pad(logp, (1, 0)) * batch.action_mask  # [N, T]

    def logprobs(self, batch: Any) -> torch.Tensor:
        with torch.no_grad():
            return self._logp(batch)

    def ref_logprobs(self, batch: Any) -> torch.Tensor | None:
        return None

    def train_step(self, batch: Any) -> Mapping[str, float]:
        self.optimizer.zero_grad()
        loss = -(self._logp(batch) * batch.advantages).sum() / batch.action_mask.sum().clamp(min=1)
        loss.backward()
        self.optimizer.step()
        self.policy_version += 1
        return {"loss": float(loss.detach())}

    def export_weights(self) -> WeightUpdate:
        from rlctl.models.fingerprint import fingerprint

        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return WeightUpdate(version=self.policy_version, state_dict=state, fingerprint=fingerprint(state))

    def save_pretrained(self, directory: str) -> None:
        self.model.save_pretrained(directory)

    def resident_tensors(self) -> Mapping[str, Sequence[torch.Tensor]]:
        return {"policy parameters": list(self.model.parameters())}


class MinimalTask:
    """A third-party TaskSource: sums of two digits."""

    def load(self) -> Any:
        from rlctl.contracts.types import PromptRecord, Split, TaskData

        rows = [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
        split = lambda part, sl: tuple(PromptRecord(id=f"{part}-{i}", text=t, answer=ans, split=Split(part))  # noqa: E731
                                       for i, (t, ans) in enumerate(rows[sl]))
        return TaskData(name="sums", version="sums-v1", train=split("train", slice(0, 80)),
                        dev=split("dev", slice(80, 90)), hidden=split("hidden", slice(90, 100)))


class MinimalReward:
    """A third-party RewardFunction: exact match of the stripped response."""

    name, version = "exact", "exact@1"

    def score(self, trajectory: Any, reference: str) -> Any:
        from rlctl.contracts.types import RewardResult

        ok = float(trajectory.response_text.strip() == reference)
        return RewardResult(total=ok, components={"exact": ok}, grader_version=self.version)


class MinimalRollout:
    """A third-party RolloutBackend: token-by-token sampling with the Hugging Face model, no cache."""

    def __init__(self, ctx: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(ctx.model_dir, local_files_only=True).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir, local_files_only=True)
        self.tokenizer_hash, self.policy_version = ctx.tokenizer_hash, ctx.policy_version
        self.generator = torch.Generator().manual_seed(ctx.seed)

    @torch.no_grad()
    def generate(self, requests: Sequence[Any]) -> list[Any]:
        import time

        from rlctl.contracts.types import TerminalReason, Trajectory

        out = []
        for req in requests:
            for g in range(req.group_size):
                ids, tokens, logps = list(req.prompt_tokens), [], []
                reason = TerminalReason.LENGTH
                for _ in range(req.sampling.max_tokens):
                    logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                    logp = torch.log_softmax(logits / req.sampling.temperature, -1)
                    token = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
                    ids.append(token)
                    tokens.append(token)
                    logps.append(float(logp[token]))
                    if token == self.tokenizer.eos_token_id:
                        reason = TerminalReason.EOS
                        break
                out.append(Trajectory.create(
                    id=f"{req.prompt_id}/{g}", prompt_id=req.prompt_id, group_index=g,
                    dataset_version=req.dataset_version, policy_version=self.policy_version,
                    tokenizer_hash=self.tokenizer_hash, prompt_tokens=tuple(req.prompt_tokens),
                    response_tokens=tuple(tokens), response_text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                    action_mask=(1,) * len(tokens), behavior_logprobs=tuple(logps), sampling_config=req.sampling,
                    terminal_reason=reason, rollout_started_at=time.time()))
        return out

    def update_weights(self, update: WeightUpdate) -> None:
        self.model.load_state_dict(update.state_dict)
        self.policy_version = update.version

    def health(self) -> Mapping[str, Any]:
        return {"ok": True, "policy_version": self.policy_version}

    def resident_tensors(self) -> Mapping[str, Sequence[torch.Tensor]]:
        return {"rollout weights": list(self.model.parameters())}

    def close(self) -> None:
        pass


class MinimalSink:
    """A third-party MetricSink: keeps what it is given."""

    written: list[tuple[int, dict[str, float]]] = []

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        MinimalSink.written.append((step, dict(metrics)))

    def close(self) -> None:
        pass


def recorder(inner: Any, members: set[str], seen: set[str]) -> Any:
    """A proxy that forwards only ``members`` and records every name asked of it."""

    def forward(name: str) -> property:
        def get(self: Any) -> Any:
            seen.add(name)
            return getattr(inner, name)

        def put(self: Any, value: Any) -> None:
            seen.add(name)
            setattr(inner, name, value)

        return property(get, put)

    def other(self: Any, name: str) -> Any:
        seen.add(name)
        return getattr(inner, name)

    # only what the backend has, so optional protocols (isinstance) see the backend's own shape
    namespace: dict[str, Any] = {name: forward(name) for name in members if hasattr(inner, name)}
    namespace["__getattr__"] = other
    return type(f"Recorded{type(inner).__name__}", (), namespace)()


class ThirdParty:
    def __init__(self) -> None:
        self.seen_learner: set[str] = set()
        self.seen_rollout: set[str] = set()

    @hookimpl
    def register_learner_backends(self, register: Any) -> None:
        from rlctl.kit import TorchLearner, TorchLearnerOptions

        register("minimal", lambda options, ctx: MinimalLearner(ctx))
        register("recorded-torch", lambda options, ctx: recorder(TorchLearner(ctx, options), LEARNER_MEMBERS,
                                                                 self.seen_learner), options=TorchLearnerOptions)

    @hookimpl
    def register_task_sources(self, register: Any) -> None:
        register("minimal", lambda options, seed=0: MinimalTask())

    @hookimpl
    def register_reward_functions(self, register: Any) -> None:
        register("minimal", lambda options: MinimalReward())

    @hookimpl
    def register_metric_sinks(self, register: Any) -> None:
        register("minimal", lambda options, run_dir, run_id: MinimalSink())

    @hookimpl
    def register_rollout_backends(self, register: Any) -> None:
        from rlctl_local_engine.engine import LocalEngine
        from rlctl_local_engine.options import LocalEngineOptions

        register("minimal", lambda options, ctx: MinimalRollout(ctx))

        register("recorded-local", lambda options, ctx: recorder(LocalEngine(ctx, options), ROLLOUT_MEMBERS,
                                                                 self.seen_rollout), options=LocalEngineOptions)


@pytest.fixture()
def home(tmp_path: Path, _rlctl_home: Path, tiny_policy_dir: Path) -> Path:
    (tmp_path / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    return tmp_path


def test_a_protocol_only_learner_trains_two_steps(home: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    plugins = load_plugins(extra={"thirdparty": ThirdParty()})
    config = load_config(None, TINY_OVERRIDES + ["train.learner=minimal", "train.steps=2", "eval.at_end=false",
                                                 "checkpoint.every_steps=0"])
    with Registry.open(f"sqlite:///{tmp_path / 'r.db'}") as reg:
        result = train(config, registry=reg, plugins=plugins, home=home, run_dir=tmp_path / "run")
        assert result.run.status == "succeeded"
        assert result.last_metrics["policy_version"] == 2.0
    initial = Path((tmp_path / "run" / "run.json").read_text().split('"initial_policy": "')[1].split('"')[0])
    start = load_file(initial / "model.safetensors")
    final = load_file(tmp_path / "run" / "policy" / "final" / "model.safetensors")
    assert any(not torch.equal(start[k], final[k]) for k in start), "two steps did not change the parameters"


def test_protocol_only_roles_run_two_steps_together(home: Path, tmp_path: Path) -> None:
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    plugins = load_plugins(extra={"thirdparty": ThirdParty()})
    overrides = [o for o in TINY_OVERRIDES if not o.startswith("task.options")] + [
        "task.source=minimal", "task.options={}", "rollout.backend=minimal", "train.learner=minimal",
        "reward.components=[{name: minimal}]", "train.metric_sinks=[minimal]", "train.steps=2", "eval.at_end=false",
        "checkpoint.every_steps=0"]
    MinimalSink.written.clear()
    with Registry.open(f"sqlite:///{tmp_path / 'r.db'}") as reg:
        result = train(load_config(None, overrides), registry=reg, plugins=plugins, home=home,
                       run_dir=tmp_path / "run")
    assert result.run.status == "succeeded" and result.last_metrics["policy_version"] == 2.0
    assert [step for step, _ in MinimalSink.written] == [0, 1]
    assert all("reward_mean" in m and "loss" in m for _, m in MinimalSink.written)
    assert (tmp_path / "run" / "policy" / "final" / "config.json").is_file()


def test_core_touches_only_protocol_members(home: Path, tmp_path: Path) -> None:
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.resume import resume
    from rlctl.planning.dryrun import DryrunOptions, smoke_step
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    third = ThirdParty()
    plugins = load_plugins(extra={"thirdparty": third})
    overrides = TINY_OVERRIDES + ["train.learner=recorded-torch", "rollout.backend=recorded-local", "train.steps=2",
                                  "eval.at_end=false", "checkpoint.every_steps=1", "algo.kl.coef=0.01",
                                  "algo.kl.placement=reward"]
    config = load_config(None, overrides)
    with Registry.open(f"sqlite:///{tmp_path / 'r.db'}") as reg:
        run = train(config, registry=reg, plugins=plugins, home=home, run_dir=tmp_path / "run").run
        resumed = resume(run.id, registry=reg, plugins=plugins, home=home, overrides=["train.steps=3"])
        assert resumed.run.status == "succeeded" and resumed.first_step == 2
    smoke_step(config, plugins, home, _task(config, plugins), DryrunOptions())
    for name in ("ref_logprobs", "save_pretrained", "resident_tensors", "checkpoint_state",
                 "load_checkpoint_state", "train_step", "export_weights", "logprobs"):
        assert name in third.seen_learner, f"the test no longer exercises {name}"
    assert third.seen_learner <= LEARNER_MEMBERS, (
        f"core uses learner attributes no Protocol declares: {sorted(third.seen_learner - LEARNER_MEMBERS)}")
    assert third.seen_rollout <= ROLLOUT_MEMBERS, (
        f"core uses rollout attributes no Protocol declares: {sorted(third.seen_rollout - ROLLOUT_MEMBERS)}")


def test_core_touches_only_protocol_members_in_the_overlapped_loop(home: Path, tmp_path: Path) -> None:
    """The same check through the overlapped driver (mode=async: producer threads, the queue, in-run recovery
    wiring), a resume included."""
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.resume import resume
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    third = ThirdParty()
    plugins = load_plugins(extra={"thirdparty": third})
    config = load_config(None, TINY_OVERRIDES + [
        "train.learner=recorded-torch", "rollout.backend=recorded-local", "train.steps=2", "eval.at_end=false",
        "checkpoint.every_steps=1", "algo.kl.coef=0.01", "algo.kl.placement=reward", "mode=async",
        "cluster.num_rollout_workers=2"])
    with Registry.open(f"sqlite:///{tmp_path / 'r.db'}") as reg:
        run = train(config, registry=reg, plugins=plugins, home=home, run_dir=tmp_path / "run").run
        resumed = resume(run.id, registry=reg, plugins=plugins, home=home, overrides=["train.steps=3"])
        assert resumed.run.status == "succeeded" and resumed.first_step == 2
    for name in ("train_step_with_logprobs", "export_weights", "checkpoint_state", "load_checkpoint_state",
                 "ref_logprobs", "save_pretrained"):
        assert name in third.seen_learner, f"the test no longer exercises {name}"
    assert {"generate", "update_weights"} <= third.seen_rollout
    assert third.seen_learner <= LEARNER_MEMBERS, sorted(third.seen_learner - LEARNER_MEMBERS)
    assert third.seen_rollout <= ROLLOUT_MEMBERS, sorted(third.seen_rollout - ROLLOUT_MEMBERS)


@pytest.mark.ray
@pytest.mark.slow
def test_core_touches_only_protocol_members_on_ray(ray_cluster, home: Path, tmp_path: Path, plugins: Any) -> None:
    """On Ray the loops talk to driver-side handles (the learner actor's RayLearner, the rollout actors'
    RayWorkers): everything core asks of them is declared on the learner Protocols and the RolloutWorker
    Protocol, and the learner actor serves nothing else by name."""
    from dataclasses import replace
    from functools import partial

    from rlctl.config.load import load_config
    from rlctl.engine.checkpoint import DiskCheckpointStore
    from rlctl.engine.drive import drive
    from rlctl.engine.producers import RolloutFleet, RolloutWorker
    from rlctl.engine.snapshot import Provenance, StepCheckpointer, recover_newest
    from rlctl.engine.spec import LoopSpec
    from rlctl.placement import place
    from rlctl.placement.ray_actors import LEARNER_CALLS

    assert LEARNER_CALLS <= LEARNER_MEMBERS, sorted(LEARNER_CALLS - LEARNER_MEMBERS)
    worker_members = protocol_members(RolloutWorker)
    config = load_config(None, TINY_OVERRIDES + [
        "cluster.backend=ray", "cluster.rollout_num_cpus=0.5", "cluster.learner_num_cpus=0.5", "mode=async",
        "train.steps=3", "algo.kl.coef=0.01", "algo.kl.placement=reward", "eval.at_end=false"])
    placement = place(config, plugins, cache_root=home / "cache")
    seen_learner: set[str] = set()
    seen_workers: set[str] = set()
    try:
        roles = placement.roles
        roles = replace(roles, learner=recorder(roles.learner, LEARNER_MEMBERS, seen_learner),
                        rollout=RolloutFleet([recorder(w, worker_members, seen_workers) for w in roles.rollout.workers]))
        store = DiskCheckpointStore(tmp_path / "checkpoints", keep_last=2, async_save=False)
        ckpt = StepCheckpointer(roles, store, Provenance(run_id="r", config_hash="h", code_version="c"),
                                every_steps=1, total_steps=3)
        drive(roles, LoopSpec.from_config(config), [], checkpoint=ckpt, directory=tmp_path, store=store,
              recover=partial(recover_newest, roles, store, 1e-4))
        restore = recover_newest(roles, store, config.checkpoint.shadow_tolerance)  # what a lost learner gets
        assert restore.step == 3
        roles.learner.save_pretrained(str(tmp_path / "final"))
    finally:
        placement.close()
    assert {"train_step_with_logprobs", "export_weights", "checkpoint_state", "load_checkpoint_state",
            "logprobs", "ref_logprobs", "save_pretrained", "policy_version"} <= seen_learner
    assert {"generate", "load_weights"} <= seen_workers
    assert seen_learner <= LEARNER_MEMBERS, sorted(seen_learner - LEARNER_MEMBERS)
    assert seen_workers <= worker_members, sorted(seen_workers - worker_members)


def _task(config: Any, plugins: Any) -> Any:
    from rlctl.placement.build import load_task

    return load_task(config, plugins)


def test_the_recorder_catches_an_undeclared_call() -> None:
    seen: set[str] = set()
    proxy = recorder(MinimalLearner.__new__(MinimalLearner), {"logprobs"}, seen)
    with pytest.raises(AttributeError):
        proxy.model  # noqa: B018 - not a Protocol member: recorded, then fails on the bare instance
    assert seen == {"model"} and not seen <= {"logprobs"}


def test_core_never_compares_against_a_backend_name(plugins: Any) -> None:
    names = {n for kind in ("rollout_backend", "learner_backend") for n in plugins.names(kind)}
    alternatives = "|".join(re.escape(n) for n in sorted(names))
    pattern = re.compile(rf"""(==|!=|\bin\s*[\(\[{{])\s*["']({alternatives})["']|["']({alternatives})["']\s*(==|!=)""")
    hits = []
    for path in sorted((REPO / "rlctl").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not hits, "core branches on a backend's name:\n" + "\n".join(hits)
