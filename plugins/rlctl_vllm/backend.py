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
  manifest), then check the version's tensor names, shapes and dtypes
  against what the servers serve *before* any server is touched (a refused
  version leaves every server on the old weights); then per server
  ``/pause?mode=wait``, ``/collective_rpc reload_weights``, verify the
  engine's own ``/weight_checker`` digests against digests computed from
  the learner's tensors (so a shard damaged on disk after the publish is
  caught), ``/resume``. A server that fails any of these is
  fenced: it gets no work until a later sync succeeds on it, and the call
  raises naming it (the learner stays paused).

Digests: the CPU build repacks linear weights and reports the digest of
zero bytes for them, so on CPU the check covers the embedding and the
norms; every parameter whose digest is not empty is compared. A failed
check means the in-place reload already happened: the server is fenced
(serves nothing) until a later sync to a good version succeeds on it.

Launched servers that die are restarted (same port) and brought to the
current version before they get work again (``rollout_server_lost``,
``rollout_server_restarted`` events); an attached server that stops
answering is fenced and its groups go, whole, to the others.

What this is not: the overlapped-mode partial-rollout machinery (issue 21
items not built yet).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlctl import RoleError, RolloutRequest, RolloutUnavailable, Trajectory, WeightUpdate
from rlctl.contracts.types import RolloutContext, TerminalReason
from rlctl.kit import Broadcaster, EngineServers, SyncOptions, eos_token_ids, report_recovery, weight_transport
from rlctl_vllm.client import ServerError, VLLMClient
from rlctl_vllm.layout import EMPTY_SHA256, differences, expected_digests, layout, state_digests
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


def launch_env(launch: LaunchOptions) -> dict[str, str]:
    """The servers' environment on top of rlctl's (launch.env wins)."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": f"{launch.kv_cache_gib:g}"}
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


class VLLMRollout:
    """RolloutBackend over vLLM servers."""

    def __init__(self, ctx: RolloutContext, options: VLLMOptions) -> None:
        self.options, self.ctx = options, ctx
        self.policy_version = ctx.policy_version
        self.tokenizer_hash = ctx.tokenizer_hash
        self.eos_ids = eos_token_ids(ctx.model_dir)
        self.engines: EngineServers | None = None
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
        report = self.broadcaster.publish(update, full=True)  # visible only once its manifest is committed
        if not report.location:
            raise RoleError(f"weight transport {self.options.weight_sync!r} published version {report.version} "
                            "nowhere a server can read by path", "use rollout.options.weight_sync=disk")
        self.policy_version = update.version
        self._sync_all(report.location, update.state_dict)
        self.last_sync["weight_sync_bytes"] = float(report.num_bytes)
        self.last_sync["weight_sync_publish_s"] = report.latency_s

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
        if not clients:
            raise RolloutUnavailable(f"no vLLM server answers to load weight version {self.policy_version}",
                                     "start the servers (or fix the network), then `rlctl resume`")
        futures = [(c, self._pool.submit(self._sync_one, c, path, state)) for c in clients]
        errors = [(c, f.exception()) for c, f in futures if f.exception() is not None]
        self.last_sync = {"weight_sync_s": time.monotonic() - started}
        for client, err in errors:
            self.fenced[client.url] = str(err)
            report_recovery("rollout_server_fenced", f"{client.url} fenced at weight version "
                            f"{self.policy_version}: {err}", {"server": client.url, "version": self.policy_version})
        if not errors:
            self.current_path = path
        if errors:
            client, err = errors[0]
            raise RoleError(f"weight version {self.policy_version} failed on {client.url} ({err}); that server is "
                            "fenced and serves nothing until a sync succeeds on it",
                            "read the server's log; the learner stays paused at this version; see `rlctl runbook "
                            "show weight-sync-failure`")

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
        for _ in range(self.options.retries + 1):
            ready = self._ready()
            futures = {k: self._pool.submit(self._complete, self.clients[self._route(requests[k].prompt_id, ready)],
                                            requests[k]) for k in pending}
            pending, lost = [], set()
            for k, future in futures.items():
                error = future.exception()
                if error is None:
                    answers[k] = future.result()
                elif isinstance(error, ServerError) and error.unreachable:
                    pending.append(k)  # the whole group again, on a server that answers
                    lost.add(error.url)
                else:
                    raise error
            for url in sorted(lost):
                report_recovery("rollout_server_lost", f"{url} unreachable during generate; its prompt groups are "
                                "generated again, whole", {"server": url})
                if self.engines is None:
                    self.fenced[url] = "unreachable during generate"
            if not pending:
                break
        if pending:
            raise RolloutUnavailable("vLLM servers kept failing past the retry bound", "read the servers' logs")
        return [t for k, req in enumerate(requests) for t in self._trajectories(req, answers[k], started)]

    def _ready(self) -> list[int]:
        """Servers that may get work: launched ones that died are restarted and resynced first."""
        if self.engines is not None:
            for i, client in enumerate(self.clients):
                if not self.engines.alive(i):
                    self._restart(i, client)
        ready = [i for i, c in enumerate(self.clients) if c.url not in self.fenced]
        if not ready:
            raise RolloutUnavailable(f"every vLLM server is fenced ({'; '.join(self.fenced.values())})",
                                     "read the servers' logs and fix the weight sync, then `rlctl resume`")
        return ready

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
        choices = sorted(client.completions(body).get("choices") or [], key=lambda c: c.get("index", 0))
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
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.engines is not None:
            self.engines.stop()
        if self._own_dir:
            shutil.rmtree(self.broadcaster.transport.root, ignore_errors=True)


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


