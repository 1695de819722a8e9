"""The ``vllm`` rollout backend: drives vLLM OpenAI-API servers over HTTP, attached or launched by rlctl.

What this is: a RolloutBackend over one or more vLLM servers:

- servers: ``servers: [URL, ...]`` attaches to running ones; a ``launch``
  block starts them (``rlctl.kit.EngineServers``: own process group,
  parent-death signal, logs, stopped at exit / Ctrl-C / SIGTERM) with
  ``--dtype float32 --enforce-eager --logprobs-mode processed_logprobs``.
- generate: tokens in, tokens out. All G samples of a prompt go to one
  server (a stable hash of the prompt id) in one ``/v1/completions`` call
  with the prompt as token ids, ``n: G``, ``logprobs: 0`` and
  ``return_tokens_as_token_ids``; the answers' ``token_id:N`` tokens and
  ``token_logprobs`` become the Trajectory's response tokens and behaviour
  logprobs (after temperature / top-k / top-p: processed_logprobs), and
  finish_reason its terminal reason. No text round trip.
- update_weights: publish the version (the disk transport's atomic
  manifest), check that the published bytes are the learner's tensors
  (every tensor) and that the version's names, shapes and dtypes match what
  the servers serve *before* any server is touched (a refused version
  leaves every server on the old weights); then per server
  ``/pause?mode=wait``, ``/collective_rpc reload_weights``, verify the
  engine's own ``/weight_checker`` digests against digests computed from
  the learner's tensors, ``/resume``. A server that fails any of these is
  fenced: it gets no work until a later sync succeeds on it. A failed
  write, damaged published bytes or a failed server check is published
  again, whole, and reloaded within ``retries`` (``weight_sync_failed``,
  ``weight_sync_recovered`` events); past that the call raises (the learner
  stays paused). A wrong layout is refused at once (no retry can fix it).

Digests: the CPU build repacks linear weights and reports the digest of
zero bytes for them, so on CPU the engine's check covers the embedding and
the norms; every parameter whose digest is not empty is compared (the
check of the published bytes covers the rest).

Recoveries (each a ``report_recovery`` event, so a registry event of the
run): a launched server that dies (``worker-crash`` SIGKILLs it) is
restarted on its port and brought to the current version before it gets
work again (``rollout_server_lost``, ``rollout_server_restarted``); its
prompt groups are generated again, whole. A server that stops answering
(``network-partition``), in generate or in a weight sync, is fenced
without failing the call; it reloads and verifies the current version when
it answers again (``rollout_server_resynced``). When no server is
left, generate waits, probing with backoff, up to ``reconnect_timeout_s``
(``rollout_partition``, ``rollout_reconnected``), then raises
``RolloutUnavailable``.

Overlapped modes: one generate call never straddles a weight sync (the
producer thread that generates also loads the weights, and ``/pause`` waits
for requests in flight), so every token of a trajectory comes from the
version it is tagged with and its behaviour logprobs are that version's.
Partial rollout (``staleness.partial_fraction``) carries whole groups over
to a later step with that version, as with the local engine. Because each
worker reloads the servers it drives, a second rollout worker of this
process (another seed) attaching to the same server is refused.

What this is not: token-level partial rollout (a group interrupted by a
weight sync and resumed on the new version, with per-token version spans):
neither this backend nor the local engine does that.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlctl import RoleError, RolloutRequest, RolloutUnavailable, Trajectory, WeightUpdate
from rlctl.contracts.types import RolloutContext, TerminalReason
from rlctl.kit import (
    Broadcaster, EngineServers, SyncOptions, eos_token_ids, fault_site, report_recovery, weight_transport,
)
from rlctl_vllm.client import ServerError, VLLMClient
from rlctl_vllm.layout import (
    EMPTY_SHA256, differences, expected_digests, layout, published_mismatches, state_digests,
)
from rlctl_vllm.options import VLLM_INSTALL, LaunchOptions, VLLMOptions, cpu_head_dim_problem


VLLM_COMMAND = ("{python}", "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}", "--host", "127.0.0.1",
                "--port", "{port}")


def launch_argv(launch: LaunchOptions, model_dir: str) -> list[str]:
    """The command of one launched server (``{port}`` filled in per server)."""
    python = launch.python
    if launch.command is None and not Path(python).exists():
        raise RoleError(f"rollout.options.launch.python {python!r} does not exist",
                        f"install vLLM in its own venv: `{VLLM_INSTALL}`, or point launch.python at its interpreter")
    check_cpu_head_dim(python, model_dir)
    return launch.argv([*VLLM_COMMAND, "--dtype", launch.dtype, "--enforce-eager", "--logprobs-mode",
                        "processed_logprobs"], model_dir)


MAX_STOP_STRINGS = 64  # per request, set on launched servers (vLLM's default is 4)


def launch_env(launch: LaunchOptions) -> dict[str, str]:
    """The servers' environment on top of rlctl's (launch.env wins)."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": f"{launch.kv_cache_gib:g}",
           # vLLM takes 4 stop strings per request by default; an environment's closing tags plus the task's
           # can be more (each tool adds one)
           "VLLM_MAX_STOP_STRINGS": str(MAX_STOP_STRINGS)}
    if launch.cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "{cpus}"  # vLLM-CPU binds its OpenMP threads itself ("auto": by NUMA)
    return {**env, **launch.env}


def check_cpu_head_dim(python: str, model_dir: str) -> None:
    """Refuse, before launching, a model whose head_dim the CPU build's attention kernels reject."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return
    problem = cpu_head_dim_problem(python, head_dim)
    if problem:
        raise RoleError(problem, "use a model whose hidden_size / num_heads is one of those (the quickstart's: "
                        "128 / 4 = 32), or the local rollout backend")


UNREACHABLE = "unreachable during generate"  # a fence a server leaves by answering again (and resyncing)


class _SyncFailed(RoleError):
    """One try of a weight sync failed at ``stage`` (published bytes, or a server's load / check): try again."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message, "read the server's log; the learner stays paused at this version; see "
                         "`rlctl runbook show weight-sync-failure`")
        self.stage = stage


class VLLMRollout:
    """RolloutBackend over vLLM servers."""

    def __init__(self, ctx: RolloutContext, options: VLLMOptions) -> None:
        self.options, self.ctx = options, ctx
        self.policy_version = ctx.policy_version
        self.tokenizer_hash = ctx.tokenizer_hash
        self.eos_ids = eos_token_ids(ctx.model_dir)
        self.engines: EngineServers | None = None
        self._claimed: list[str] = []
        self._pool: ThreadPoolExecutor | None = None
        root = Path(options.publish_dir) if options.publish_dir else Path(tempfile.mkdtemp(prefix="rlctl-weights-"))
        self._own_dir = options.publish_dir is None
        extra = [Path(ctx.model_dir) / n for n in ("config.json", "generation_config.json")]
        self.broadcaster = Broadcaster(
            weight_transport(options.weight_sync, options.weight_sync_options, root, extra,
                             where="rollout.options.weight_sync_options"),
            SyncOptions(encoding="raw", delta=False, bucket_bytes=options.bucket_bytes))
        self.served = layout(ctx.model_dir)  # what every in-sync server holds: names -> (dtype, shape)
        self.fenced: dict[str, str] = {}  # url -> why it serves nothing
        self.last_sync: dict[str, float] = {}
        self._calls = 0
        self.current_path = str(ctx.model_dir)  # what an in-sync server holds (a restarted one is brought here)
        try:
            self._start(ctx, options)
        except BaseException:
            self.close()
            raise

    def _start(self, ctx: RolloutContext, options: VLLMOptions) -> None:
        urls = options.servers or []
        _claim(urls, ctx.seed)
        self._claimed = list(urls)
        if options.launch is not None:
            launch = options.launch
            self.engines = launch.servers(launch_argv(launch, str(ctx.model_dir)), name="vLLM",
                                          env=launch_env(launch)).start()
            urls = self.engines.urls
        api_key = os.environ.get(options.api_key_env) or None
        self.clients = [VLLMClient(url, options.timeout_s, api_key) for url in urls]
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.clients)), thread_name_prefix="rlctl-vllm")
        self.model_ids = {c.url: c.model_id() for c in self.clients}
        if options.launch is None and options.sync_on_start:
            self._sync_all(str(ctx.model_dir))

    @property
    def startup_s(self) -> list[float]:
        return list(self.engines.startup_s) if self.engines else []

    # -- weight sync -----------------------------------------------------------------------

    def update_weights(self, update: WeightUpdate) -> None:
        """Publish and load ``update``; a failed write, damaged bytes or a server's failed check is published
        again, whole, and reloaded within the retry bound (``weight_sync_failed`` / ``weight_sync_recovered``)."""
        self.policy_version = update.version
        for attempt in range(self.options.retries + 1):
            report = None
            try:
                report = self.broadcaster.publish(update, full=True)  # visible only once its manifest is committed
                if not report.location:
                    raise RoleError(f"weight transport {self.options.weight_sync!r} published version "
                                    f"{report.version} nowhere a server can read by path",
                                    "use rollout.options.weight_sync=disk")
                fault_site("weights.published", location=report.location, version=update.version)  # (injected)
                self._check_published(report.location, update.state_dict)
                self._sync_all(report.location, update.state_dict)
                break
            except (OSError, _SyncFailed) as err:
                stage = "publish" if isinstance(err, OSError) else err.stage
                if report is not None and report.location:  # the transport reuses a committed version as it is:
                    shutil.rmtree(report.location, ignore_errors=True)  # the next try writes it again, whole
                report_recovery("weight_sync_failed", f"weight version {update.version} failed at {stage} (try "
                                f"{attempt + 1}): {err}", {"version": update.version, "try": attempt + 1,
                                                            "stage": stage})
                if attempt == self.options.retries:
                    raise RoleError(f"weight version {update.version} failed {attempt + 1} times ({err}); the "
                                    "learner stays paused at this version and a server that failed it is fenced",
                                    "read the servers' logs (and free space in rollout.options.publish_dir); see "
                                    "`rlctl runbook show weight-sync-failure`") from None
                time.sleep(self.options.retry_backoff_s * (2 ** attempt))
        if attempt:
            report_recovery("weight_sync_recovered", f"weight version {update.version} loaded and verified after "
                            f"{attempt + 1} tries", {"version": update.version, "tries": attempt + 1})
        self.last_sync["weight_sync_bytes"] = float(report.num_bytes)
        self.last_sync["weight_sync_publish_s"] = report.latency_s

    def _check_published(self, path: str, state: Mapping[str, Any]) -> None:
        """The published bytes against the learner's tensors, every tensor, before any server reads them (the
        CPU build's own digests cover only the embedding and the norms)."""
        wrong = published_mismatches(path, state)
        if wrong:
            raise _SyncFailed("published", f"the published bytes of {wrong[:5]} at {path} differ from the "
                              "learner's tensors; no server loaded them")

    def _sync_all(self, path: str, state: Mapping[str, Any] | None = None) -> None:
        """Load ``path`` on every server, or refuse it before any server is touched."""
        problems = differences(self.served, layout(path))
        if problems:
            report_recovery("weight_sync_failed", f"weight version {self.policy_version} refused before loading: "
                            f"{'; '.join(problems)}", {"version": self.policy_version, "stage": "layout"})
            raise RoleError(f"weight version {self.policy_version} at {path} does not match what the vLLM servers "
                            f"serve ({'; '.join(problems)}); nothing was loaded, the servers keep the previous "
                            "version", "publish the same architecture the servers were started with (vLLM "
                            "reloads in place: a new shape needs new servers)")
        started = time.monotonic()
        clients = [c for c in self.clients if c.url not in self.fenced or c.healthy(timeout_s=2.0)]
        if not clients and state is None:
            raise RolloutUnavailable(f"no vLLM server answers to load weight version {self.policy_version}",
                                     "start the servers (or fix the network), then `rlctl resume`")
        for client in self.clients:
            if client not in clients:  # away: it reloads this version when it answers again (generate waits)
                self.fenced[client.url] = UNREACHABLE
        futures = [(c, self._pool.submit(self._sync_one, c, path, state)) for c in clients]
        outcomes = [(c, f.exception()) for c, f in futures]  # waits for every server
        self.last_sync = {"weight_sync_s": time.monotonic() - started}
        errors = []
        for client, err in outcomes:
            if err is None:
                continue
            away = isinstance(err, ServerError) and err.unreachable
            self.fenced[client.url] = UNREACHABLE if away else str(err)
            report_recovery("rollout_server_fenced", f"{client.url} fenced at weight version "
                            f"{self.policy_version}: {err}", {"server": client.url, "version": self.policy_version})
            if not away:  # an unreachable one is resynced to this version when it answers again
                errors.append((client, err))
        if not errors:
            self.current_path = path
        if errors:
            client, err = errors[0]
            raise _SyncFailed("load", f"weight version {self.policy_version} failed on {client.url} ({err}); "
                              "that server is fenced and serves nothing until a sync succeeds on it")

    def _sync_one(self, client: VLLMClient, path: str, state: Mapping[str, Any] | None) -> None:
        client.pause()
        try:
            answer = client.reload_weights(path)
            if not (isinstance(answer, dict) and isinstance(answer.get("results"), list)):
                raise RoleError(f"{client.url}: reload_weights answered {str(answer)[:200]!r}",
                                "the server must run with VLLM_SERVER_DEV_MODE=1")
            if self.options.verify_checksums:
                self._verify(client, path, state)
        except BaseException:
            self.fenced[client.url] = "a weight reload did not complete"  # fenced before it can serve again
            try:
                client.resume()  # its queue must not hang; it still gets no work while fenced
            except ServerError:
                pass
            raise
        self.fenced.pop(client.url, None)
        client.resume()

    def _verify(self, client: VLLMClient, path: str, state: Mapping[str, Any] | None) -> None:
        """The engine's own digests against the learner's tensors (or, at startup, the model directory's bytes)."""
        served = {n: d for n, d in client.checksums().items() if d != EMPTY_SHA256}
        expected = state_digests(state, list(served)) if state is not None else expected_digests(path, list(served))
        wrong = sorted(n for n, d in expected.items() if served[n] != d)
        if wrong or not expected:
            raise RoleError(f"{client.url}: after reloading {path} the engine's weight checksums differ from the "
                            f"learner's weights for {wrong[:5] or 'every parameter (none comparable)'}",
                            "the reload was partial or read other bytes; the server is fenced")

    # -- RolloutBackend ----------------------------------------------------------------------

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        if not requests:
            return []
        self._calls += 1
        started = time.time()
        answers: dict[int, list[dict[str, Any]]] = {}
        pending = list(range(len(requests)))
        for attempt in range(self.options.retries + 1):
            ready = self._ready()
            if attempt == 0:  # a server crash (injected): its pid, for launched servers
                fault_site("rollout.dispatch", clients=self.clients,
                           pids=[p and p.pid for p in self.engines.procs] if self.engines is not None else ())
            routes = {k: self._route(requests[k].prompt_id, ready) for k in pending}
            futures = {k: self._pool.submit(self._complete, self.clients[i], requests[k]) for k, i in routes.items()}
            pending, lost = [], {}
            for k, future in futures.items():
                error = future.exception()
                if error is None:
                    answers[k] = future.result()
                elif isinstance(error, ServerError) and error.unreachable:
                    pending.append(k)  # the whole group again, on a server that answers
                    lost[error.url] = lost.get(error.url, 0) + 1
                else:
                    raise error
            for url, groups in sorted(lost.items()):
                report_recovery("rollout_server_lost", f"{url} unreachable during generate; its {groups} prompt "
                                "group(s) are generated again, whole", {"server": url, "groups": groups})
                self.fenced[url] = UNREACHABLE  # a launched one that died is restarted, others probed
            if not pending:
                break
        if pending:
            raise RolloutUnavailable("vLLM servers kept failing past the retry bound", "read the servers' logs")
        return [t for k, req in enumerate(requests) for t in self._trajectories(req, answers[k], started)]

    def _ready(self) -> list[int]:
        """Servers that may get work: launched ones that died are restarted and resynced first, unreachable ones
        that answer again are resynced; when none is left, wait for one (a partition) up to reconnect_timeout_s."""
        ready = self._probe()
        if ready:
            return ready
        if UNREACHABLE not in self.fenced.values():
            raise RolloutUnavailable(f"every vLLM server is fenced ({'; '.join(self.fenced.values())})",
                                     "read the servers' logs and fix the weight sync, then `rlctl resume`")
        started, urls = time.monotonic(), [c.url for c in self.clients]
        report_recovery("rollout_partition", f"no vLLM server reachable; generation paused, probing for up to "
                        f"{self.options.reconnect_timeout_s:g}s", {"servers": urls})
        delay = 0.1
        while not ready:
            waited = time.monotonic() - started
            if waited >= self.options.reconnect_timeout_s:
                raise RolloutUnavailable(f"no vLLM server of {urls} reachable for {waited:.0f}s",
                                         "start the servers or fix the network, then `rlctl resume`; see `rlctl "
                                         "runbook show network-partition`")
            time.sleep(min(delay, self.options.reconnect_timeout_s - waited))
            delay = min(delay * 2, 5.0)
            ready = self._probe()
        report_recovery("rollout_reconnected", f"vLLM server(s) {[urls[i] for i in ready]} back after "
                        f"{time.monotonic() - started:.1f}s, resynced to weight version {self.policy_version}",
                        {"servers": [urls[i] for i in ready], "down_s": round(time.monotonic() - started, 3)})
        return ready

    def _probe(self) -> list[int]:
        for i, client in enumerate(self.clients):
            if self.engines is not None and not self.engines.alive(i):
                self._restart(i, client)
            elif self.fenced.get(client.url) == UNREACHABLE and client.healthy(timeout_s=2.0):
                try:  # it may have missed a weight version while away: it serves only after it confirms this one
                    self._sync_one(client, self.current_path, None)
                except (RoleError, OSError):
                    self.fenced[client.url] = UNREACHABLE
                    continue
                report_recovery("rollout_server_resynced", f"{client.url} answers again; reloaded and verified "
                                f"weight version {self.policy_version} before it gets work",
                                {"server": client.url, "version": self.policy_version})
        return [i for i, c in enumerate(self.clients) if c.url not in self.fenced]

    def _restart(self, i: int, client: VLLMClient) -> None:
        report_recovery("rollout_server_lost", f"launched vLLM server {client.url} exited; restarting it",
                        {"server": client.url, "log": str(self.engines.log_path(i))})
        self.fenced[client.url] = "restarting"
        started = time.monotonic()
        self.engines.restart(i)  # it starts on the run's starting model
        if self.current_path != str(self.ctx.model_dir):
            self._sync_one(client, self.current_path, None)  # raises (fenced) if the current version fails
        self.fenced.pop(client.url, None)
        report_recovery("rollout_server_restarted", f"{client.url} restarted and confirmed at weight version "
                        f"{self.policy_version} in {time.monotonic() - started:.1f}s",
                        {"server": client.url, "version": self.policy_version})

    def _route(self, prompt_id: str, ready: Sequence[int]) -> int:
        """Group-sticky: a prompt's server by a stable hash (prefix-cache reuse)."""
        h = int(hashlib.sha1(prompt_id.encode()).hexdigest()[:12], 16)
        return ready[h % len(ready)]

    def _complete(self, client: VLLMClient, req: RolloutRequest) -> list[dict[str, Any]]:
        s = req.sampling
        body: dict[str, Any] = {
            "model": self.model_ids[client.url], "prompt": list(req.prompt_tokens), "n": req.group_size,
            "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1, "logprobs": 0, "return_tokens_as_token_ids": True,
            "skip_special_tokens": False, "seed": _seed(self.ctx.seed, req.prompt_id, self._calls)}
        if s.stop:
            body["stop"] = list(s.stop)
            body["include_stop_str_in_output"] = True  # keep the text aligned with the tokens
        try:
            answer = client.completions(body)
        except ServerError as err:
            if err.status == 400 and "body.stop" in err.message:
                raise RoleError(f"vLLM server {client.url} refused the request's {len(s.stop)} stop strings "
                                "(the task's and the environment's, one closing tag per tool): it takes at most "
                                "VLLM_MAX_STOP_STRINGS, 4 unless set",
                                f"start the server with VLLM_MAX_STOP_STRINGS={MAX_STOP_STRINGS} in its "
                                "environment (servers rlctl launches have it), or use fewer tools") from None
            raise
        choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != req.group_size:
            raise RoleError(f"{client.url} answered {len(choices)} completions for n={req.group_size}",
                            "check the server's log")
        return choices

    def _trajectories(self, req: RolloutRequest, choices: Sequence[Mapping[str, Any]],
                      started: float) -> list[Trajectory]:
        out = []
        for g, choice in enumerate(choices):
            tokens, logprobs = _parse(choice)
            out.append(Trajectory.create(
                id=f"{req.prompt_id}/v{self.policy_version}/c{self._calls}/{g}", prompt_id=req.prompt_id,
                group_index=g, dataset_version=req.dataset_version, policy_version=self.policy_version,
                tokenizer_hash=self.tokenizer_hash, prompt_tokens=tuple(req.prompt_tokens),
                response_tokens=tokens, response_text=str(choice.get("text", "")), action_mask=(1,) * len(tokens),
                behavior_logprobs=logprobs, sampling_config=req.sampling,
                terminal_reason=self._reason(choice, tokens), rollout_started_at=started))
        return out

    def _reason(self, choice: Mapping[str, Any], tokens: Sequence[int]) -> TerminalReason:
        finish = choice.get("finish_reason")
        if finish == "length":
            return TerminalReason.LENGTH
        if finish == "stop":
            if choice.get("stop_reason") is None or (tokens and tokens[-1] in self.eos_ids):
                return TerminalReason.EOS
            return TerminalReason.STOP
        return TerminalReason.ABORT

    def health(self) -> Mapping[str, Any]:
        servers = [{"url": c.url, "healthy": c.healthy(), "fenced": self.fenced.get(c.url)} for c in self.clients]
        return {"ok": all(s["healthy"] and not s["fenced"] for s in servers), "policy_version": self.policy_version,
                "servers": servers, "last_sync": dict(self.last_sync), "startup_s": self.startup_s}

    def use_run_dir(self, run_dir: str) -> None:
        """RunDirAware: move the launched servers' logs to ``<run_dir>/engines/`` (open logs keep writing there;
        across file systems a link there points at them instead)."""
        if self.engines is None:
            return
        self.engines.move_logs(Path(run_dir) / "engines")

    def resident_tensors(self) -> Mapping[str, Sequence[Any]]:
        return {}  # the weights live in the vLLM server processes

    def close(self) -> None:
        _release(self._claimed, self.ctx.seed)
        self._claimed = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.engines is not None:
            self.engines.stop()
        if self._own_dir:
            shutil.rmtree(self.broadcaster.transport.root, ignore_errors=True)


_DRIVERS: dict[str, list[int]] = {}  # attached server -> seeds of the live backends of this process driving it
_DRIVERS_LOCK = threading.Lock()


def _claim(urls: Sequence[str], seed: int) -> None:
    """Refuse a second rollout worker (another seed) on an attached server: each worker reloads the servers
    it drives to its own weight version, so two would tag each other's samples with the wrong version. A
    rebuild of the same worker (same seed) and grading (the run's seed, worker 0's) may share them."""
    with _DRIVERS_LOCK:
        for url in urls:
            if any(other != seed for other in _DRIVERS.get(url, ())):
                raise RoleError(f"vLLM server {url} is already driven by another rollout worker of this run; two "
                                "workers would reload it at different weight versions and mislabel samples",
                                "set cluster.num_rollout_workers=1 (the servers in rollout.options.servers are "
                                "the parallelism)")
        for url in urls:
            _DRIVERS.setdefault(url, []).append(seed)


def _release(urls: Sequence[str], seed: int) -> None:
    with _DRIVERS_LOCK:
        for url in urls:
            seeds = _DRIVERS.get(url, [])
            if seed in seeds:
                seeds.remove(seed)


def _parse(choice: Mapping[str, Any]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    lp = choice.get("logprobs") or {}
    names, values = lp.get("tokens") or [], lp.get("token_logprobs") or []
    if len(names) != len(values) or not all(isinstance(t, str) and t.startswith("token_id:") for t in names):
        raise RoleError(f"a vLLM answer has {len(names)} tokens and {len(values)} logprobs, or tokens not as ids",
                        "the request sets logprobs: 0 and return_tokens_as_token_ids; is this a vLLM server?")
    tokens = tuple(int(t.split(":", 1)[1]) for t in names)
    logprobs = tuple(float(v) for v in values)
    if not all(v <= 0.0 and v == v and v != float("-inf") for v in logprobs):
        raise RoleError("a vLLM answer has a non-finite or positive logprob",
                        "the engine's numerics are broken; check its dtype and log")
    return tokens, logprobs


def _seed(seed: int, prompt_id: str, call: int) -> int:
    return int(hashlib.sha1(f"{seed}/{prompt_id}/{call}".encode()).hexdigest()[:8], 16)


