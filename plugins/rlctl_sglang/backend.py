"""The ``sglang`` rollout backend: drives SGLang-API servers over HTTP.

What this is: a RolloutBackend that talks to one or more servers, a real
SGLang (``python -m sglang.launch_server``) or ``rlctl serve rollout``:

- generate: all G samples of a prompt go to one server, chosen by a stable
  hash of the prompt id (prefix-cache reuse); each server gets one
  batched ``/generate`` call with ``input_ids`` and ``return_logprob``; the
  answers become Trajectory records exactly like the local engine's
  (behaviour logprobs per token, terminal reason from finish_reason, the
  policy version the server reports for that answer).
- update_weights: publish the version with the disk Broadcaster (atomic
  manifest), POST ``/update_weights_from_disk`` with the version directory
  and ``weight_version`` to every server, then confirm each server reports
  that version (and, on rlctl servers, the weight fingerprint). It retries a
  bounded number of times and then raises, so the learner, which calls this
  synchronously, stays paused until every server confirms (no sample is
  drawn from an unconfirmed version).
- health and resync: before each generate every server's version is read; a
  server reporting another version (restarted, or it missed an update) is
  resynced with a full copy of the current version before it gets work, and
  an answer tagged with a stale version is discarded and regenerated. An
  unreachable server's prompts go, group by group, to the next healthy one.
- outages: when no server is reachable (a network partition, every server
  crashed) the step waits, probing with backoff, up to ``reconnect_timeout_s``;
  a server that comes back is fenced (it serves only after it confirms the
  current version, resynced if needed) and the groups of the failed call are
  sent again whole, so no group is generated twice into the batch. Past the
  timeout generate raises ``RolloutUnavailable`` (the overlapped driver
  re-queues the prompts and restarts the worker; the synchronous loop stops).
- a weight publish that fails (a shard write error, or a version a server
  refuses because its checksum does not match) is written again and resent,
  within the retry bound; the server keeps serving its previous version
  meanwhile, never a half-applied one, and the learner stays paused.

Every such recovery is reported (``report_recovery``) and becomes a registry
event of the run: ``rollout_server_lost``, ``rollout_partition``,
``rollout_reconnected``, ``rollout_server_resynced``, ``weight_sync_failed``,
``weight_sync_recovered``.

Logprobs: real SGLang returns log_softmax(logits / T) before top-k / top-p,
while rlctl's learner recomputes logprobs under the truncated distribution, so
with a real SGLang server this backend refuses top_p < 1 or top_k > 0 instead
of training on biased ratios. ``rlctl serve rollout`` reports
``logprobs: sampled-distribution`` and may use any sampling config.

Servers: ``servers: [URL, ...]`` attaches to running ones; a ``launch``
block starts them (``rlctl.kit.EngineServers``, the same launcher as the
vllm plugin's: own process group, parent-death signal, CPU / GPU pinning,
logs under the run directory, stopped at exit / Ctrl-C / SIGTERM) with
``python -m sglang.launch_server`` (or ``launch.command``, e.g. ``rlctl
serve rollout``). A launched server that exits is restarted on its port and
resynced before it gets work (``rollout_server_lost``,
``rollout_server_restarted``).
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlctl import RoleError, RolloutRequest, RolloutUnavailable, Trajectory, WeightUpdate
from rlctl.contracts.types import RolloutContext, SamplingConfig, TerminalReason
from rlctl.kit import (
    Broadcaster, EngineServers, PublishReport, SyncOptions, await_confirmation, eos_token_ids, fault_site,
    report_recovery, weight_transport,
)
from rlctl_sglang.client import ServerClient, ServerError
from rlctl_sglang.options import SGLANG_INSTALL, SGLangLaunch, SGLangOptions

RLCTL_LOGPROBS = "sampled-distribution"
SGLANG_COMMAND = ("{python}", "-m", "sglang.launch_server", "--model-path", "{model}", "--host", "127.0.0.1",
                  "--port", "{port}")


def launch_argv(launch: SGLangLaunch, model_dir: str) -> list[str]:
    """The command of one launched server (``{port}`` and the pinning filled in per server)."""
    if launch.command is None and not Path(launch.python).exists():
        raise RoleError(f"rollout.options.launch.python {launch.python!r} does not exist",
                        f"install SGLang in its own venv: `{SGLANG_INSTALL}`, point launch.python at its "
                        "interpreter, or set launch.command (e.g. to `rlctl serve rollout`)")
    return launch.argv(SGLANG_COMMAND, model_dir)


class SGLangRollout:
    """RolloutBackend over SGLang-API servers."""

    def __init__(self, ctx: RolloutContext, options: SGLangOptions) -> None:
        self.options, self.ctx = options, ctx
        self.policy_version = ctx.policy_version
        self.tokenizer_hash = ctx.tokenizer_hash
        self.eos_ids = eos_token_ids(ctx.model_dir)
        self.engines: EngineServers | None = None
        urls = options.servers or []
        if options.launch is not None:
            self.engines = options.launch.servers(launch_argv(options.launch, str(ctx.model_dir)),
                                                  name="SGLang").start()
            urls = self.engines.urls
        api_key = os.environ.get(options.api_key_env) or None
        self.clients = [ServerClient(url, options.timeout_s, api_key) for url in urls]
        self._own_dir = options.publish_dir is None
        root = Path(options.publish_dir) if options.publish_dir else Path(tempfile.mkdtemp(prefix="rlctl-weights-"))
        extra = [Path(ctx.model_dir) / n for n in ("config.json", "generation_config.json")]
        self.broadcaster = Broadcaster(
            weight_transport(options.weight_sync, options.weight_sync_options, root, extra,
                             where="rollout.options.weight_sync_options"),
            SyncOptions(encoding=options.encoding, delta=options.delta, bucket_bytes=options.bucket_bytes))
        self.fingerprint: str | None = None  # of the version being served (None until known)
        self.last_publish: PublishReport | None = None
        self._kinds: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.clients)), thread_name_prefix="rlctl-sglang")
        self._calls = 0
        self._fenced: set[str] = set()  # urls of unreachable servers left out of weight syncs until they answer
        self._refused: set[str] = set()  # published locations a server refused (damaged): rewritten before a retry
        self._pending: WeightUpdate | None = None  # the update being synced, to rewrite a refused version
        try:
            for client in self.clients:
                self._kinds[client.url] = self._kind(client.model_info())
            self._check_servers_support_options()
            if options.sync_on_start:
                self._sync_all(str(ctx.model_dir), None)
        except BaseException:
            self.close()
            raise

    # -- servers ---------------------------------------------------------------------

    @staticmethod
    def _kind(info: Mapping[str, Any]) -> str:
        return "rlctl" if isinstance(info.get("rlctl"), dict) else "sglang"

    def _check_servers_support_options(self) -> None:
        real = [url for url, kind in self._kinds.items() if kind == "sglang"]
        if real and (self.options.delta or self.options.encoding == "fp8"):
            raise RoleError(f"{real[0]} is an SGLang server, which loads plain safetensors directories only; "
                            "delta and fp8 publishes need `rlctl serve rollout`",
                            "set rollout.options.delta=false and rollout.options.encoding=raw (or bf16)")

    def _confirm(self, client: ServerClient, version: str, fingerprint: str | None) -> tuple[bool, str]:
        try:
            info = client.model_info()
        except ServerError as err:
            return False, str(err)
        self._kinds[client.url] = self._kind(info)
        if str(info.get("weight_version")) != version:
            return False, f"{client.url} reports weight_version {info.get('weight_version')!r}, expected {version}"
        served = (info.get("rlctl") or {}).get("fingerprint")
        if fingerprint and served and served != fingerprint:
            return False, f"{client.url} serves fingerprint {served}, the published version has {fingerprint}"
        return True, ""

    def _load(self, client: ServerClient, path: str, version: str, fingerprint: str | None) -> tuple[bool, str]:
        try:
            answer = client.update_weights_from_disk(path, version)
        except ServerError as err:
            if err.status is not None and err.status < 500:
                self._refused.add(path)  # the server read the version and rejected it: rewrite it before a retry
            return False, str(err)
        if isinstance(answer, dict) and answer.get("success") is False:
            self._refused.add(path)
            return False, f"{client.url} refused {path}: {answer.get('message')}"
        return self._confirm(client, version, fingerprint)

    def _sync_one(self, client: ServerClient, report: PublishReport | None) -> None:
        """Bring one server to the current version (bounded retries, then RoleError)."""
        version = str(self.policy_version)
        tries = 0

        def attempt() -> tuple[bool, str]:
            nonlocal tries
            tries += 1  # after a refused try, send a full copy: the server may not hold the delta's base
            path, fingerprint = self._source_for(client, report, force_full=tries > 1)
            if path in self._refused:
                path, fingerprint = self._rewrite(path)
            ok, detail = self._load(client, path, version, fingerprint)
            if not ok:
                report_recovery("weight_sync_failed", f"weight version {version} not confirmed on {client.url} "
                                f"(try {tries}): {detail}", {"server": client.url, "version": version, "try": tries})
            return ok, detail

        used = await_confirmation(attempt, what=f"weight version {version} on {client.url}",
                                  retries=self.options.retries, backoff_s=self.options.retry_backoff_s)
        if used > 1:
            report_recovery("weight_sync_recovered", f"weight version {version} confirmed on {client.url} after "
                            f"{used} tries; the learner was paused meanwhile",
                            {"server": client.url, "version": version, "tries": used})

    def _source_for(self, client: ServerClient, report: PublishReport | None,
                    force_full: bool = False) -> tuple[str, str | None]:
        """Where ``client`` loads the current version from: the delta only if it holds the delta's base."""
        if report is None:
            if self.last_publish is None:
                return str(self.ctx.model_dir), self.fingerprint
            report = self.last_publish
        if report.delta:
            try:
                held = str(client.model_info().get("weight_version"))
            except ServerError:
                held = None
            if force_full or held != str(report.manifest.base_version):
                with self._lock:  # a full copy of the same version; later resyncs reuse it
                    report = self.last_publish = self.broadcaster.republish_full()
        if not report.location:
            raise RoleError(f"weight transport {self.options.weight_sync!r} published version {report.version} "
                            "nowhere a server can read by path", "use rollout.options.weight_sync=disk (or another "
                            "transport that writes a directory every server can read)")
        return report.location, report.manifest.fingerprint

    def _rewrite(self, location: str) -> tuple[str, str | None]:
        """Write the refused version again as a fresh full copy (once, whichever server thread gets here first)."""
        with self._lock:
            last = self.last_publish
            if last is not None and last.location == location and self._pending is not None:
                shutil.rmtree(location, ignore_errors=True)
                self.last_publish = last = self.broadcaster.publish(self._pending, full=True)
                self._refused.discard(last.location)
                report_recovery("weight_sync_failed", f"weight version {last.version} in {location} was refused "
                                f"by a server; written again", {"version": last.version, "location": location})
            if last is None:  # the starting model directory: nothing to rewrite, retry as it is
                return location, self.fingerprint
            return last.location, last.manifest.fingerprint

    def _publish(self, update: WeightUpdate) -> PublishReport:
        """Publish ``update``; a failed write (disk full, I/O error) is retried within the retry bound."""
        for attempt in range(self.options.retries + 1):
            try:
                report = self.broadcaster.publish(update, full=attempt > 0)
                break
            except OSError as err:
                report_recovery("weight_sync_failed", f"publishing weight version {update.version} failed (try "
                                f"{attempt + 1}): {err}", {"version": update.version, "try": attempt + 1,
                                                             "stage": "publish"})
                if attempt == self.options.retries:
                    raise RoleError(f"publishing weight version {update.version} failed {attempt + 1} times: {err}",
                                    "the learner stayed paused at this version; free space or fix the publish "
                                    "directory (rollout.options.publish_dir), then resume; see `rlctl runbook show "
                                    "weight-sync-failure`") from None
                time.sleep(self.options.retry_backoff_s * (2 ** attempt))
        if attempt:
            report_recovery("weight_sync_recovered", f"weight version {update.version} published after "
                            f"{attempt + 1} tries", {"version": update.version, "tries": attempt + 1,
                                                      "stage": "publish"})
        fault_site("weights.published", location=report.location, version=update.version)  # bit rot (injected)
        return report

    def _sync_all(self, path: str, report: PublishReport | None) -> None:
        clients = self.clients
        if report is not None:  # a fenced (unreachable) server is skipped until it answers again
            clients = [c for c in clients if c.url not in self._fenced or c.healthy(timeout_s=2.0)]
            if not clients:  # every server is fenced: the learner waits for one to come back and confirm
                self._await_reachable("every rollout server is unreachable")
                return
        futures = [self._pool.submit(self._sync_one, c, report) for c in clients]
        failed = [(c, f.exception()) for c, f in zip(clients, futures) if f.exception() is not None]
        for c, f in zip(clients, futures):
            if f.exception() is None:
                self._fenced.discard(c.url)
        if failed and (report is None or len(failed) == len(clients) or any(c.healthy() for c, _ in failed)):
            raise failed[0][1]  # nobody confirmed, or a reachable server refused: the learner stays paused
        for client, err in failed:
            self._fenced.add(client.url)
            report_recovery("rollout_server_fenced", f"{client.url} is unreachable at weight version "
                            f"{self.policy_version}: fenced, it gets work again only after it confirms the "
                            f"current version ({err})", {"server": client.url, "version": self.policy_version})
        if report is None and self.fingerprint is None:  # starting weights: every rlctl server must agree
            prints = {info.get("rlctl", {}).get("fingerprint") for info in self._infos() if info.get("rlctl")}
            if len(prints) > 1:
                raise RoleError(f"rollout servers loaded {path} with different fingerprints {sorted(prints)}",
                                "the servers run different model code or dtypes; start them the same way")
            self.fingerprint = prints.pop() if prints else None

    def _infos(self) -> list[dict[str, Any]]:
        return [c.model_info() for c in self.clients]

    def _ready_servers(self) -> list[int]:
        """Indices of servers that answer and serve the current version (resyncing the ones that do not)."""
        ready = []
        for i, client in enumerate(self.clients):
            if self.engines is not None and not self.engines.alive(i):
                self._restart(i, client)
            ok, _ = self._confirm(client, str(self.policy_version), self.fingerprint)
            if not ok and client.healthy():
                try:
                    self._sync_one(client, None)
                    ok = True
                    report_recovery("rollout_server_resynced", f"{client.url} did not serve weight version "
                                    f"{self.policy_version}; resynced before it gets work",
                                    {"server": client.url, "version": self.policy_version})
                except RoleError:
                    ok = False
            if ok:
                ready.append(i)
        return ready

    def _restart(self, i: int, client: ServerClient) -> None:
        """A launched server exited: start it again on its port (the resync in _ready_servers follows)."""
        report_recovery("rollout_server_lost", f"launched SGLang server {client.url} exited; restarting it",
                        {"server": client.url, "log": str(self.engines.log_path(i))})
        started = time.monotonic()
        try:
            self.engines.restart(i)
        except RoleError as err:
            report_recovery("rollout_server_fenced", f"{client.url} did not come back: {err}", {"server": client.url})
            return  # not ready: its groups go to the others, or the step waits for reconnect_timeout_s
        report_recovery("rollout_server_restarted", f"{client.url} restarted in {time.monotonic() - started:.1f}s; "
                        f"resynced to weight version {self.policy_version} before it serves",
                        {"server": client.url, "version": self.policy_version})

    def use_run_dir(self, run_dir: str) -> None:
        """RunDirAware: move the launched servers' logs to ``<run_dir>/engines/`` (open logs keep writing there;
        across file systems a link there points at them instead)."""
        if self.engines is None:
            return
        self.engines.move_logs(Path(run_dir) / "engines")

    # -- RolloutBackend ------------------------------------------------------------------

    def update_weights(self, update: WeightUpdate) -> None:
        self._pending = update
        try:
            report = self._publish(update)  # visible only once its manifest is committed
            # From here the committed version is the target: a server that does not confirm it within the
            # retry bound fails this call (the learner stays paused) and is resynced before it serves again.
            self.policy_version, self.fingerprint = update.version, report.manifest.fingerprint
            self.last_publish = report
            self._sync_all(report.location, report)
        finally:
            self._pending = None

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        if not requests:
            return []
        self._calls += 1
        started = time.time()
        ready = self._ready_servers() or self._await_reachable("no server answers or serves the current version")
        self._check_logprob_semantics(requests, ready)
        pending: dict[int, list[int]] = {}
        for k, req in enumerate(requests):
            pending.setdefault(self._route(req.prompt_id, ready), []).append(k)
        answers: dict[int, list[dict[str, Any]]] = {}
        fault_site("rollout.dispatch", clients=self.clients)  # a server crash (injected)
        for _ in range(self.options.retries + 1):
            if not pending:
                break
            futures = {i: self._pool.submit(self._generate_on, self.clients[i], [requests[k] for k in ks])
                       for i, ks in pending.items()}
            retry: dict[int, list[int]] = {}
            for i, future in futures.items():
                error = future.exception()
                if error is None:
                    answers.update(zip(pending[i], future.result()))
                    continue
                if not (isinstance(error, ServerError) and error.unreachable):
                    raise error
                ready = [r for r in ready if r != i]  # move this server's groups, whole, to others
                report_recovery("rollout_server_lost", f"{self.clients[i].url} unreachable during generate "
                                f"({error}); its {len(pending[i])} prompt group(s) are generated again, whole",
                                {"server": self.clients[i].url, "groups": len(pending[i])})
                if not ready:  # wait for one to come back; past reconnect_timeout_s: RolloutUnavailable
                    ready = self._await_reachable(str(error))
                for k in pending[i]:
                    retry.setdefault(self._route(requests[k].prompt_id, ready), []).append(k)
            pending = retry
        if pending:
            raise RoleError("rollout servers kept failing past the retry bound", "check the servers' logs")
        out: list[Trajectory] = []
        for k, req in enumerate(requests):
            out.extend(self._trajectories(req, answers[k], started))
        return out

    def _await_reachable(self, why: str) -> list[int]:
        """No server can serve: wait (probing with backoff) until one is back in sync, up to reconnect_timeout_s."""
        started = time.monotonic()
        urls = [c.url for c in self.clients]
        report_recovery("rollout_partition", f"no rollout server reachable ({why}); generation paused, probing "
                        f"for up to {self.options.reconnect_timeout_s:g}s", {"servers": urls})
        delay = max(0.05, self.options.retry_backoff_s)
        while True:
            waited = time.monotonic() - started
            if waited >= self.options.reconnect_timeout_s:
                raise RolloutUnavailable(f"no rollout server of {urls} reachable for {waited:.0f}s (first: {why})",
                                "start the servers or fix the network, then `rlctl resume`; see `rlctl runbook show "
                                "network-partition`")
            time.sleep(min(delay, max(0.0, self.options.reconnect_timeout_s - waited)))
            delay = min(delay * 2, 5.0)
            ready = self._ready_servers()  # fences: a server serves only once it confirms the current version
            if ready:
                report_recovery("rollout_reconnected", f"rollout server(s) {[urls[i] for i in ready]} back after "
                                f"{time.monotonic() - started:.1f}s, confirmed at weight version "
                                f"{self.policy_version}", {"servers": [urls[i] for i in ready],
                                                           "down_s": round(time.monotonic() - started, 3)})
                return ready

    def health(self) -> Mapping[str, Any]:
        servers = []
        for client in self.clients:
            ok, detail = self._confirm(client, str(self.policy_version), self.fingerprint)
            servers.append({"url": client.url, "kind": self._kinds.get(client.url), "in_sync": ok, "detail": detail})
        out: dict[str, Any] = {"ok": all(s["in_sync"] for s in servers), "policy_version": self.policy_version,
                               "fingerprint": self.fingerprint, "servers": servers}
        if self.last_publish is not None:
            out["last_publish"] = self.last_publish.metrics()
        return out

    def resident_tensors(self) -> Mapping[str, Sequence[Any]]:
        return {}  # the weights live in the SGLang server processes

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.engines is not None:
            self.engines.stop()
        if self._own_dir:
            shutil.rmtree(self.broadcaster.transport.root, ignore_errors=True)

    # -- generate helpers ------------------------------------------------------------------

    def _route(self, prompt_id: str, ready: Sequence[int]) -> int:
        """Group-sticky: a prompt's home server by hash; if it is down, a stable pick among the rest."""
        h = int(hashlib.sha1(prompt_id.encode()).hexdigest()[:12], 16)
        home = h % len(self.clients)
        if home in ready:
            return home
        if not ready:
            raise RolloutUnavailable("no rollout server serves the current weight version",
                                     "start the servers (rlctl resyncs them on the next step)")
        return ready[h % len(ready)]

    def _check_logprob_semantics(self, requests: Sequence[RolloutRequest], ready: Sequence[int]) -> None:
        real = [self.clients[i].url for i in ready if self._kinds.get(self.clients[i].url) != "rlctl"]
        truncating = next((r.sampling for r in requests if r.sampling.top_p < 1.0 or r.sampling.top_k > 0), None)
        if real and truncating is not None:
            raise RoleError(
                f"{real[0]} is an SGLang server: it returns behaviour logprobs before top-k/top-p truncation "
                f"(log_softmax(logits/T)), but rlctl's learner scores tokens under the truncated distribution "
                f"(top_p={truncating.top_p}, top_k={truncating.top_k}), so every importance ratio would be biased",
                "set rollout.top_p=1.0 and rollout.top_k=0 for real SGLang, or serve with `rlctl serve rollout`")

    def _generate_on(self, client: ServerClient, requests: Sequence[RolloutRequest]) -> list[list[dict[str, Any]]]:
        """One batched /generate for ``requests`` on ``client``; answers tagged with a stale version are redone."""
        version = str(self.policy_version)
        body = {"input_ids": [list(r.prompt_tokens) for r in requests for _ in range(r.group_size)],
                "sampling_params": [_sampling_params(r.sampling) for r in requests for _ in range(r.group_size)],
                "return_logprob": True,
                "rid": [f"{r.prompt_id}/c{self._calls}/{j}/{g}" for j, r in enumerate(requests)
                        for g in range(r.group_size)]}
        detail = ""
        for attempt in range(self.options.retries + 1):
            items = client.generate(body)
            items = items if isinstance(items, list) else [items]
            stale = sorted({str(it.get("meta_info", {}).get("weight_version")) for it in items} - {version})
            if not stale and len(items) == len(body["input_ids"]):
                grouped, row = [], 0
                for r in requests:
                    grouped.append(items[row:row + r.group_size])
                    row += r.group_size
                return grouped
            detail = f"answers tagged weight_version {stale}" if stale else f"{len(items)} answers for " \
                                                                          f"{len(body['input_ids'])} prompts"
            self._sync_one(client, None)  # restarted or missed an update: resync, then regenerate
        raise RoleError(f"{client.url} kept answering with the wrong weights ({detail})",
                        "restart that server; rlctl resyncs it to the current version")

    def _trajectories(self, req: RolloutRequest, items: Sequence[dict[str, Any]], started: float) -> list[Trajectory]:
        out = []
        for g, item in enumerate(items):
            tokens, logprobs, reason = self._parse(item, req.sampling)
            out.append(Trajectory.create(
                id=f"{req.prompt_id}/v{self.policy_version}/c{self._calls}/{g}", prompt_id=req.prompt_id,
                group_index=g, dataset_version=req.dataset_version, policy_version=self.policy_version,
                tokenizer_hash=self.tokenizer_hash, prompt_tokens=tuple(req.prompt_tokens),
                response_tokens=tokens, response_text=str(item.get("text", "")), action_mask=(1,) * len(tokens),
                behavior_logprobs=logprobs, sampling_config=req.sampling, terminal_reason=reason,
                rollout_started_at=started))
        return out

    def _parse(self, item: Mapping[str, Any], sampling: SamplingConfig
               ) -> tuple[tuple[int, ...], tuple[float, ...], TerminalReason]:
        meta = item.get("meta_info") or {}
        tokens = tuple(int(t) for t in item.get("output_ids") or ())
        entries = meta.get("output_token_logprobs") or []
        logprobs = tuple(float(e[0]) for e in entries)
        if tuple(int(e[1]) for e in entries) != tokens:
            raise RoleError(f"server answer {meta.get('id')}: output_token_logprobs do not match output_ids "
                            f"({len(entries)} entries for {len(tokens)} tokens)",
                            "the server must return output-token logprobs (return_logprob, logprob_start_len=-1)")
        if not all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs):
            raise RoleError(f"server answer {meta.get('id')} has a non-finite or positive logprob",
                            "the rollout server's numerics are broken; check its dtype and logs")
        return tokens, logprobs, self._reason(meta.get("finish_reason"))

    def _reason(self, finish: Any) -> TerminalReason:
        kind = finish.get("type") if isinstance(finish, dict) else None
        if kind == "length":
            return TerminalReason.LENGTH
        if kind == "stop":
            matched = finish.get("matched")
            ids = set(matched) if isinstance(matched, list) else {matched}
            return TerminalReason.EOS if ids & self.eos_ids else TerminalReason.STOP
        return TerminalReason.ABORT


def _sampling_params(s: SamplingConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p}
    if s.top_k > 0:
        params["top_k"] = s.top_k
    if s.stop:
        params["stop"] = list(s.stop)
        params["no_stop_trim"] = True  # keep the text aligned with the tokens, as the local engine does
    return params

