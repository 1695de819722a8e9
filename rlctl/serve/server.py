"""``rlctl serve rollout``: a rollout backend behind SGLang's native HTTP API (the subset rlctl uses).

Routes (SGLang 0.5.x shapes):

    POST /generate                   input_ids | text, sampling_params, return_logprob (batched)
    POST /update_weights_from_disk   model_path = an rlctl publish directory (manifest verified,
                                     delta applied) or a plain Hugging Face model directory
    GET|POST /flush_cache            nothing is cached across requests: always "Cache flushed."
    GET /health, /health_generate    200 when the engine thread is alive
    GET /get_model_info, /model_info model path, weight_version, plus an ``rlctl`` block with the
                                     policy version, weight fingerprint and logprob semantics
    GET /get_server_info, /server_info  batching counters

Weight updates run on the engine thread between batches and all-or-nothing
(the backend checks the fingerprint), so a request never sees half-old,
half-new weights; a refused update leaves the previous version serving and
answers 400 with the reason (e.g. the corrupt shard's name).

What this is not: a production server; it binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import itertools
import json
import signal
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

from rlctl.contracts.errors import RlctlError, RoleError
from rlctl.serve.sglang_api import LOGPROB_SEMANTICS, ApiError, generate_response, parse_generate, response_item


class RolloutService:
    """The routes' logic over one engine worker, independent of HTTP plumbing."""

    def __init__(self, engine: Any, tokenizer: Any, model_dir: str, *, backend: str = "local",
                 weight_version: str = "default", max_wait_s: float = 0.005, max_batch_rows: int = 512) -> None:
        from rlctl.serve.worker import EngineWorker

        self.tokenizer, self.model_dir, self.backend = tokenizer, model_dir, backend
        self.eos_id = tokenizer.eos_token_id
        self.worker = EngineWorker(engine, weight_version=weight_version, max_wait_s=max_wait_s,
                                   max_batch_rows=max_batch_rows)
        self._rids = itertools.count()
        self._config = _read_config(Path(model_dir))

    # -- /generate -----------------------------------------------------------------

    def generate(self, body: Any) -> tuple[int, Any]:
        started = time.perf_counter()
        call = parse_generate(body, lambda text: self.tokenizer(text)["input_ids"], lambda: f"req-{next(self._rids)}")
        trajectories, version = self.worker.generate(call.rows)
        latency = time.perf_counter() - started
        items = [response_item(row, traj, eos_id=self.eos_id, weight_version=version, latency_s=latency)
                 for row, traj in zip(call.rows, trajectories)]
        return 200, generate_response(call, items)

    # -- weights -------------------------------------------------------------------

    def update_weights_from_disk(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return 400, {"success": False, "message": "model_path (a directory) is required", "num_paused_requests": 0}
        version = body.get("weight_version")
        try:
            apply = self._prepare_update(Path(body["model_path"]), None if version is None else str(version))
            message = self.worker.call(apply)
        except RlctlError as err:
            return 400, {"success": False, "message": str(err), "num_paused_requests": 0}
        return 200, {"success": True, "message": message, "num_paused_requests": 0}

    def _prepare_update(self, path: Path, weight_version: str | None) -> Callable[[Any], str]:
        """Read and verify off the engine thread; return the step that applies on it."""
        from rlctl.engine.transports.disk import fetch_directory, is_version_dir
        from rlctl.engine.weight_sync import decode_manifest

        if not path.is_dir():
            raise RoleError(f"model_path {path} is not a directory", "pass a published version or model directory")
        if is_version_dir(path):
            manifest, stored = fetch_directory(path)  # refuses uncommitted dirs and bad shards, by name

            def apply_manifest(worker: Any) -> str:
                engine = worker.engine
                base = engine.state_dict() if manifest.is_delta and hasattr(engine, "state_dict") else None
                update = decode_manifest(manifest, stored, base=base,
                                         base_fingerprint=engine.health().get("fingerprint"))
                engine.update_weights(update)
                worker.weight_version = weight_version or str(manifest.version)
                return f"updated to weight version {worker.weight_version} (fingerprint {update.fingerprint})"

            return apply_manifest
        state = _load_hf_state(path)

        def apply_plain(worker: Any) -> str:
            from rlctl.contracts.types import WeightUpdate
            from rlctl.models.fingerprint import fingerprint

            engine = worker.engine
            number = int(weight_version) if weight_version and weight_version.isdigit() else engine.policy_version
            update = WeightUpdate(version=number, state_dict=state, fingerprint=fingerprint(state))
            engine.update_weights(update)
            worker.weight_version = weight_version or worker.weight_version
            return f"loaded {path} as weight version {worker.weight_version} (fingerprint {update.fingerprint})"

        return apply_plain

    # -- info ------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        health = self.worker.engine.health()
        return {
            "model_path": self.model_dir, "tokenizer_path": self.model_dir, "is_generation": True,
            "weight_version": self.worker.weight_version, "model_type": self._config.get("model_type"),
            "architectures": self._config.get("architectures"),
            "rlctl": {"engine": self.backend, "policy_version": health.get("policy_version"),
                      "fingerprint": health.get("fingerprint"), "logprobs": LOGPROB_SEMANTICS},
        }

    def server_info(self) -> dict[str, Any]:
        s = self.worker.stats
        return {"weight_version": self.worker.weight_version, "max_batch_rows": self.worker.max_batch_rows,
                "rlctl": {"batches": s.batches, "requests": s.requests, "rows": s.rows,
                          "largest_batch_rows": s.largest_batch_rows,
                          "largest_batch_requests": s.largest_batch_requests}}

    def close(self) -> None:
        self.worker.close()


def _read_config(model_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _load_hf_state(path: Path) -> dict[str, Any]:
    from rlctl.models.load import load_policy

    model, _ = load_policy(path)
    return {k: v.detach() for k, v in model.state_dict().items()}


# -- HTTP plumbing -------------------------------------------------------------------


def _handler(service: RolloutService, verbose: bool) -> type[BaseHTTPRequestHandler]:
    posts: dict[str, Callable[[Any], tuple[int, Any]]] = {
        "/generate": service.generate,
        "/update_weights_from_disk": service.update_weights_from_disk,
    }
    gets: dict[str, Callable[[], tuple[int, Any]]] = {
        "/health": lambda: (200, None), "/health_generate": lambda: (200, None),
        "/get_model_info": lambda: (200, service.model_info()), "/model_info": lambda: (200, service.model_info()),
        "/get_server_info": lambda: (200, service.server_info()), "/server_info": lambda: (200, service.server_info()),
        "/flush_cache": lambda: (200, "Cache flushed."),
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            route = gets.get(self.path.split("?", 1)[0])
            self._answer(route if route else lambda: (404, {"error": f"no route {self.path}"}))

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if path in gets:
                self._answer(gets[path])
                return
            route = posts.get(path)
            if route is None:
                self._answer(lambda: (404, {"error": f"no route {path}"}))
                return
            try:
                body = json.loads(raw) if raw else {}
            except json.JSONDecodeError as err:
                self._send(400, {"error": f"body is not JSON: {err}"})
                return
            self._answer(lambda: route(body))

        def _answer(self, fn: Callable[[], tuple[int, Any]]) -> None:
            try:
                status, payload = fn()
            except ApiError as err:
                status, payload = err.status, {"error": err.message}
            except RlctlError as err:
                status, payload = 400, {"error": str(err)}
            except Exception as err:  # noqa: BLE001 - a bug: keep serving, report it, keep the traceback
                traceback.print_exc(file=sys.stderr)
                status, payload = 500, {"error": f"internal error: {type(err).__name__}: {err}"}
            self._send(status, payload)

        def _send(self, status: int, payload: Any) -> None:
            if payload is None:
                data, kind = b"", "text/plain"
            elif isinstance(payload, str):
                data, kind = payload.encode(), "text/plain; charset=utf-8"
            else:
                data, kind = json.dumps(payload).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            if verbose:
                super().log_message(format, *args)

    return Handler


def build_service(model_dir: str | Path, *, backend: str = "local", seed: int = 0, weight_version: str = "default",
                  max_wait_s: float = 0.005, max_batch_rows: int = 512) -> RolloutService:
    """Load the tokenizer and build the named rollout backend through the plugin registry."""
    from transformers import AutoTokenizer

    from rlctl.contracts.types import RolloutContext
    from rlctl.hooks.manager import load_plugins
    from rlctl.models.load import check_model_dir
    from rlctl.models.tokenizer import tokenizer_hash

    root = check_model_dir(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    ctx = RolloutContext(model_dir=str(root), tokenizer_hash=tokenizer_hash(root), seed=seed)
    engine = load_plugins().build("rollout_backend", backend, {}, "serve --backend", ctx=ctx)
    return RolloutService(engine, tokenizer, str(root), backend=backend, weight_version=weight_version,
                          max_wait_s=max_wait_s, max_batch_rows=max_batch_rows)


def serve(service: RolloutService, host: str, port: int, *, verbose: bool = False,
          ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT / SIGTERM; ``ready(url)`` is called once the socket listens."""
    try:
        httpd = ThreadingHTTPServer((host, port), _handler(service, verbose))
    except OSError as err:
        service.close()
        raise RoleError(f"cannot listen on {host}:{port}: {err.strerror}",
                        "pick a free port with --port (0 lets the OS choose) or stop what holds it") from err
    httpd.daemon_threads = True
    url = f"http://{host}:{httpd.server_address[1]}"

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if ready is not None:
            ready(url)
        httpd.serve_forever(poll_interval=0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        httpd.server_close()
        service.close()
