"""``rlctl serve rollout``: a rollout backend behind SGLang's native HTTP API (the subset rlctl uses).

Routes (SGLang 0.5.x shapes):

    POST /generate                   input_ids | text, sampling_params, return_logprob (batched)
    POST /update_weights_from_disk   model_path = an rlctl publish directory (manifest verified,
                                     delta applied) or a plain Hugging Face model directory
    GET|POST /flush_cache            nothing is cached across requests: always "Cache flushed."
    GET /health                      200 while the engine thread is alive
    GET /health_generate             200 once a real one-token generation finished in time, else 503
    GET /get_model_info, /model_info model path, weight_version, plus an ``rlctl`` block with the
                                     policy version, weight fingerprint, logprob semantics and limits
    GET /get_server_info, /server_info  batching counters
    GET /metrics                     Prometheus text: requests and errors by route and status, latency,
                                     batch rows, queue depth, engine time, weight version

Weight updates are all or nothing: the candidate is read and checked whole
(every shard's sha256 for a publish; the safetensors headers of a plain
directory against the served names, shapes and dtypes before any tensor is
read), then staged and swapped in on the engine thread between batches
(rlctl.engine.weight_apply). A refused update answers 400 with the reason and
leaves every served tensor and the reported fingerprint unchanged. Weights
with a NaN or an infinity are refused before they are staged.

Hardening: the HTTP part, shared with ``serve reward``, is uvicorn + Starlette
configured by rlctl.serve.listener and rlctl.serve.asgi (trust, body limits,
request deadlines, connection limits, errors in SGLang's shape). Here: limits
checked at parse time (prompts per request, prompt tokens, max_new_tokens,
token ids, finite numbers, strict types, unknown fields; all 400 naming the
field); continuous batching across requests (rlctl.serve.continuous, ``--scheduler``), or fair
slices and per-request isolation in the batch engine worker;
generation cancelled when the client disconnects or on shutdown;
``weight_version`` short printable ASCII; ``weights_root`` confines
``model_path`` and every symlink inside it, and errors about paths outside
it, or paths that are not weight directories, read the same whether they exist.

What this is not: a production server (use SGLang itself on GPUs).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from rlctl.contracts.errors import RlctlError, RoleError
from rlctl.contracts.roles import ReadableWeights
from rlctl.serve.http_common import ApiError, Cancelled, GetRoute, HttpOptions, PostRoute, Routes
from rlctl.serve.listener import HttpServer, serve_until_signal
from rlctl.serve.sglang_api import (
    LOGPROB_SEMANTICS, UPDATE_KEYS, Limits, Row, check_weight_version, error_shape, generate_response,
    parse_generate, response_item, unknown_key, update_error_shape,
)

MAX_PATH_CHARS = 4096


class RolloutService:
    """The routes' logic over one engine worker, independent of HTTP plumbing."""

    def __init__(self, engine: Any, tokenizer: Any, model_dir: str, *, backend: str = "local",
                 weight_version: str = "default", max_wait_s: float = 0.005, max_batch_rows: int = 256,
                 limits: Limits | None = None, weights_root: str | Path | None = None, scheduler: str = "auto") -> None:
        from rlctl.serve.continuous import ContinuousWorker, can_serve_continuously
        from rlctl.serve.metrics import ServeMetrics
        from rlctl.serve.worker import EngineWorker, accepts_ignore_eos

        try:
            weight_version = check_weight_version(weight_version)
        except ApiError as err:
            raise RoleError(err.message, "pass another --weight-version") from None
        self.tokenizer, self.model_dir, self.backend = tokenizer, model_dir, backend
        self.eos_id = tokenizer.eos_token_id
        self._config = _read_config(Path(model_dir))
        self.limits = limits or default_limits(self._config, tokenizer)
        self.scheduler = _pick_scheduler(scheduler, can_serve_continuously(engine), backend)
        self.limits = dataclasses.replace(self.limits, ignore_eos=accepts_ignore_eos(engine))
        self.weights_root = Path(os.path.realpath(weights_root)) if weights_root is not None else None
        self.metrics = ServeMetrics(collect=self._families)
        if self.scheduler == "continuous":
            self.worker: EngineWorker = ContinuousWorker(engine, weight_version=weight_version,
                                                         max_batch_rows=max_batch_rows,
                                                         observe=self.metrics.observe_batch)
        else:
            self.worker = EngineWorker(engine, weight_version=weight_version, max_wait_s=max_wait_s,
                                       max_batch_rows=max_batch_rows, observe=self.metrics.observe_batch)
        self._rids = itertools.count()
        self._state_lock = threading.Lock()  # weights + weight_version change together, and are read together
        served = engine.state_dict() if isinstance(engine, ReadableWeights) else {}
        self._layout = {name: (tuple(t.shape), t.dtype) for name, t in served.items()}
        self._tied = _aliases(served)

    # -- /generate -----------------------------------------------------------------

    def generate(self, body: Any, gone: Callable[[], bool] | None = None) -> tuple[int, Any]:
        started = time.perf_counter()
        call = parse_generate(body, self._tokenize, lambda: f"req-{next(self._rids)}", self.limits)
        trajectories, versions = self.worker.generate(call.rows, gone=gone)
        latency = time.perf_counter() - started
        items = [response_item(row, traj, eos_id=self.eos_id, weight_version=version, latency_s=latency)
                 for row, traj, version in zip(call.rows, trajectories, versions)]
        return 200, generate_response(call, items)

    def _tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def health_generate(self, timeout_s: float) -> tuple[int, Any]:
        """A real one-token greedy generation through the worker, bounded by ``timeout_s``."""
        from rlctl.contracts.types import SamplingConfig

        token = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eos_id
        row = Row(input_ids=(int(token),), sampling=SamplingConfig(temperature=0.0, max_tokens=1),
                  rid=f"health-{next(self._rids)}", return_logprob=False, no_stop_trim=False)
        started = time.perf_counter()
        try:
            self.worker.generate([row], timeout_s=timeout_s)
        except TimeoutError:
            raise ApiError(503, f"a one-token generation did not finish within {timeout_s:g}s") from None
        except Cancelled as err:
            raise ApiError(503, err.message) from None
        return 200, {"ok": True, "latency_s": round(time.perf_counter() - started, 4)}

    # -- weights -------------------------------------------------------------------

    def update_weights_from_disk(self, body: Any) -> tuple[int, Any]:
        def refuse(status: int, message: str) -> tuple[int, Any]:
            return status, {"success": False, "message": message, "num_paused_requests": 0}

        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str) or not body["model_path"]:
            return refuse(400, "model_path (a directory) is required")
        try:
            unknown_key(body, UPDATE_KEYS, "the /update_weights_from_disk body")
            version = None if body.get("weight_version") is None else check_weight_version(body["weight_version"])
        except ApiError as err:
            return refuse(err.status, err.message)
        if body.get("load_format") not in (None, "auto", "safetensors"):
            return refuse(400, f"load_format {str(body.get('load_format'))[:40]!r} is not supported; "
                               "this server loads safetensors only")
        try:
            path = self._confine(body["model_path"])
        except ApiError as err:
            return refuse(err.status, err.message)
        try:
            apply = self._prepare_update(path, version)
        except RlctlError as err:
            return refuse(400, str(err))
        except Exception as err:  # noqa: BLE001 - reading the candidate failed; nothing served changed
            return refuse(400, f"cannot read the weights in {path}: {type(err).__name__}: {str(err)[:300]}")
        try:
            message = self.worker.call(apply)
        except Cancelled as err:
            return refuse(503, err.message)
        except RlctlError as err:
            return refuse(400, str(err))
        return 200, {"success": True, "message": message, "num_paused_requests": 0}

    def _confine(self, raw: str) -> Path:
        """The real path ``raw`` names, if the server may load from it; one message for every refusal."""
        if len(raw) > MAX_PATH_CHARS or "\0" in raw:
            raise ApiError(400, f"model_path is longer than {MAX_PATH_CHARS} characters or holds a NUL byte")
        shown = raw if len(raw) <= 200 else raw[:200] + "..."
        try:
            real = Path(os.path.realpath(raw))
        except (OSError, ValueError):
            real = None
        if self.weights_root is not None:
            inside = real is not None and (real == self.weights_root or self.weights_root in real.parents)
            if not inside or _link_out_of(real, self.weights_root):  # a weight file may not point out of it
                raise ApiError(403, f"model_path {shown} is outside the server's weights root; it loads weights "
                                    f"only from under {self.weights_root}")
        unloadable = ApiError(400, f"model_path {shown} is not a loadable weight directory (a committed rlctl "
                                   "publish, or a directory with config.json and model.safetensors)")
        try:
            if real is None or not real.is_dir() or not os.access(real, os.R_OK | os.X_OK):
                raise unloadable
            names = set(os.listdir(real))
        except OSError:
            raise unloadable from None
        if not names & {"manifest.json", "manifest.json.tmp", "model.safetensors", "model.safetensors.index.json"}:
            raise unloadable
        return real

    def _prepare_update(self, path: Path, weight_version: str | None) -> Callable[[Any], str]:
        """Read and verify off the engine thread; return the step that applies on it."""
        from rlctl.engine.transports.disk import fetch_directory, is_version_dir
        from rlctl.engine.weight_sync import decode_manifest

        if is_version_dir(path):
            manifest, stored = fetch_directory(path)  # refuses uncommitted dirs and bad shards, by name

            def apply_manifest(worker: Any) -> str:
                engine = worker.engine
                with self._state_lock:
                    base = engine.state_dict() if manifest.is_delta and isinstance(engine, ReadableWeights) else None
                    update = decode_manifest(manifest, stored, base=base,
                                             base_fingerprint=engine.health().get("fingerprint"))
                    refuse_non_finite(update.state_dict, path.name)
                    engine.update_weights(update)
                    worker.weight_version = weight_version or str(manifest.version)
                return f"updated to weight version {worker.weight_version} (fingerprint {update.fingerprint})"

            return apply_manifest
        state = read_model_dir(path, self._layout, self._tied)
        refuse_non_finite(state, path.name)

        def apply_plain(worker: Any) -> str:
            from rlctl.contracts.types import WeightUpdate
            from rlctl.models.fingerprint import fingerprint

            engine = worker.engine
            number = int(weight_version) if weight_version and weight_version.isdigit() and len(weight_version) <= 18 \
                else engine.policy_version
            update = WeightUpdate(version=number, state_dict=state, fingerprint=fingerprint(state))
            with self._state_lock:
                engine.update_weights(update)
                worker.weight_version = weight_version or worker.weight_version
            return f"loaded {path} as weight version {worker.weight_version} (fingerprint {update.fingerprint})"

        return apply_plain

    # -- info ------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        with self._state_lock:
            health = self.worker.engine.health()
            version = self.worker.weight_version
        return {
            "model_path": self.model_dir, "tokenizer_path": self.model_dir, "is_generation": True,
            "weight_version": version, "model_type": self._config.get("model_type"),
            "architectures": self._config.get("architectures"),
            "max_total_num_tokens": self.limits.positions,
            "rlctl": {"engine": self.backend, "policy_version": health.get("policy_version"),
                      "fingerprint": health.get("fingerprint"), "logprobs": LOGPROB_SEMANTICS,
                      "limits": {**self.limits.to_dict(), "max_batch_rows": self.worker.max_batch_rows},
                      "weights_root_confined": self.weights_root is not None},
        }

    def _families(self) -> list[Any]:
        """What /metrics reports of the engine thread, read at scrape time."""
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

        from rlctl.serve.metrics import worker_families

        worker = self.worker
        out = worker_families(worker.stats, queue_depth=worker.queue_depth, busy=worker.busy, engine="engine")
        out.append(InfoMetricFamily("rlctl_weight_version", "The weight version being served",
                                    value={"weight_version": worker.weight_version}))
        out.append(GaugeMetricFamily("rlctl_policy_version", "The engine's policy version",
                                     value=worker.engine.policy_version))
        return out

    def server_info(self) -> dict[str, Any]:
        s = self.worker.stats
        return {"weight_version": self.worker.weight_version, "max_batch_rows": self.worker.max_batch_rows,
                "rlctl": {"scheduler": self.scheduler, "batches": s.batches, "requests": s.requests, "rows": s.rows,
                          "largest_batch_rows": s.largest_batch_rows,
                          "largest_batch_requests": s.largest_batch_requests,
                          "retried_alone": s.retried_alone, "cancelled": s.cancelled, "idle": self.worker.idle,
                          "pid": os.getpid()}}

    def close(self, timeout_s: float = 5.0) -> None:
        self.worker.close(timeout_s)


SCHEDULERS = ("auto", "continuous", "batch")


def check_scheduler(scheduler: str) -> None:
    """One error naming the choices for an unknown ``--scheduler`` (before any model loads)."""
    if scheduler not in SCHEDULERS:
        raise RoleError(f"--scheduler {scheduler!r} is not one of {', '.join(SCHEDULERS)}", "pick one of them")


def _pick_scheduler(scheduler: str, continuous_ok: bool, backend: str) -> str:
    """``auto``: continuous where the backend can run it (the local engine on a fast-path model), else batch."""
    check_scheduler(scheduler)
    if scheduler == "continuous" and not continuous_ok:
        raise RoleError(f"--scheduler continuous needs a backend that opens decode sessions (the local engine on an "
                        f"fp32 Llama/Qwen2-shaped model); backend {backend!r} with this model cannot",
                        "pass --scheduler batch (or auto)")
    if scheduler == "auto":
        return "continuous" if continuous_ok else "batch"
    return scheduler


def _link_out_of(directory: Path, root: Path, max_entries: int = 10_000) -> bool:
    """True when a symlink under ``directory`` resolves outside ``root`` (or the tree is too large to check)."""
    seen = 0
    for parent, dirs, files in os.walk(directory, followlinks=False):
        for name in dirs + files:
            seen += 1
            entry = Path(parent) / name
            if seen > max_entries:
                return True
            if entry.is_symlink():
                target = Path(os.path.realpath(entry))
                if target != root and root not in target.parents:
                    return True
    return False


def refuse_non_finite(state: Mapping[str, Any], where: str) -> None:
    """RoleError naming the first floating tensor holding a NaN or an infinity (checked before staging)."""
    import torch

    for name, tensor in state.items():
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise RoleError(f"tensor {name} in {where} holds NaN or infinite values; nothing was loaded",
                            "publish finite weights (a diverged learner wrote these)")


def default_limits(config: Mapping[str, Any], tokenizer: Any, **overrides: Any) -> Limits:
    """Limits from the model's config (positions, vocabulary) plus server settings in ``overrides``."""
    positions = config.get("max_position_embeddings") or getattr(tokenizer, "model_max_length", None) or 2048
    vocab = config.get("vocab_size") or len(tokenizer)
    return Limits(positions=int(min(positions, 1 << 20)), vocab_size=int(vocab),
                  **{k: v for k, v in overrides.items() if v is not None})


def _read_config(model_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _aliases(served: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """name -> every other name sharing its tensor (tied weights a checkpoint may store once)."""
    groups: dict[tuple[int, int], list[str]] = {}
    for name in sorted(served):
        t = served[name]
        if t.numel():
            groups.setdefault((t.untyped_storage().data_ptr(), t.storage_offset()), []).append(name)
    return {n: tuple(m for m in names if m != n) for names in groups.values() if len(names) > 1 for n in names}


_ST_TO_TORCH = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_model_dir(path: Path, layout: Mapping[str, tuple[tuple[int, ...], Any]],
                   tied: Mapping[str, tuple[str, ...]]) -> dict[str, Any]:
    """The tensors of a plain Hugging Face safetensors directory, checked against the served layout first.

    Every file's header is read and every name, shape and dtype compared
    with what is served before any tensor data is read, so a directory of
    another architecture (or a huge one) costs nothing and changes nothing.
    A tensor tied to another in the served model may be stored once.
    """
    import torch
    from safetensors import SafetensorError, safe_open

    files = _weight_files(path)
    where: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name in where:
                        raise RoleError(f"tensor {name} is stored twice in {path.name} ({where[name].name}, "
                                        f"{file.name})", "rewrite the model with save_pretrained")
                    if name not in layout:
                        raise RoleError(f"{file.name} holds tensor {name}, which the served model does not have",
                                        "load a model of the served architecture")
                    part = handle.get_slice(name)
                    shape, dtype = tuple(part.get_shape()), _ST_TO_TORCH.get(part.get_dtype(), part.get_dtype())
                    want_shape, want_dtype = layout[name]
                    if shape != want_shape:
                        raise RoleError(f"tensor {name} in {file.name} has shape {shape}, the served model has "
                                        f"{want_shape}", "load a model of the served architecture and size")
                    got = getattr(torch, dtype, None)
                    if got != want_dtype and not (isinstance(got, torch.dtype) and got.is_floating_point
                                                  and want_dtype.is_floating_point):
                        raise RoleError(f"tensor {name} in {file.name} has dtype {dtype}, the served model has "
                                        f"{want_dtype}", "load a model with the served dtypes")
                    where[name] = file
        except SafetensorError as err:
            raise RoleError(f"{file.name} in {path.name} is not a valid safetensors file: {err}",
                            "rewrite the model with save_pretrained") from None
    missing = sorted(n for n in layout if n not in where and not any(m in where for m in tied.get(n, ())))
    if missing:
        raise RoleError(f"{path.name} lacks {len(missing)} tensor(s) the served model has, e.g. {missing[0]}",
                        "load a full model of the served architecture")
    state: dict[str, Any] = {}
    for file in files:
        names = [n for n, f in where.items() if f == file]
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in names:
                    state[name] = handle.get_tensor(name)
        except SafetensorError as err:
            raise RoleError(f"{file.name} in {path.name} could not be read: {err}", "rewrite the model") from None
    for name in layout:
        if name not in state:
            state[name] = next(state[m] for m in tied[name] if m in state)
    return state


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, AttributeError) as err:
            raise RoleError(f"{index.name} in {path.name} is not valid JSON: {type(err).__name__}",
                            "rewrite the model with save_pretrained") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise RoleError(f"{index.name} in {path.name} has no weight_map", "rewrite the model with save_pretrained")
        names = sorted({str(v) for v in weight_map.values()})
        for name in names:
            if Path(name).name != name or not name.endswith(".safetensors") or not (path / name).is_file():
                raise RoleError(f"{index.name} in {path.name} names {name[:80]!r}, which is not a safetensors "
                                "file in that directory", "rewrite the model with save_pretrained")
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise RoleError(f"{path.name} has no model.safetensors (or index); only safetensors weights load",
                    "save the model with save_pretrained(safe_serialization=True)")


# -- HTTP ---------------------------------------------------------------------------------


class RolloutServer(HttpServer):
    """A listening ``rlctl serve rollout``: ``serve_forever()`` in one thread, ``shutdown()`` from another."""

    def __init__(self, service: RolloutService, host: str, port: int, *, http: HttpOptions | None = None,
                 verbose: bool = False) -> None:
        http = http or HttpOptions()
        self.service = service
        super().__init__(rollout_routes(service, http), host, port, http=http, verbose=verbose,
                         cancel=service.worker.cancel_all,  # generations stop at their next decode step
                         close=lambda timeout_s: service.close(timeout_s=timeout_s),
                         risk="swap the served weights")


def rollout_routes(service: RolloutService, http: HttpOptions) -> Routes:
    posts: dict[str, PostRoute] = {
        "/generate": lambda body, gone: service.generate(body, gone),
        "/update_weights_from_disk": lambda body, gone: service.update_weights_from_disk(body),
        "/flush_cache": lambda body, gone: (200, "Cache flushed."),
    }
    gets: dict[str, GetRoute] = {
        "/health": lambda: (200, None) if service.worker.alive else (503, None),
        "/health_generate": lambda: service.health_generate(http.health_timeout_s),
        "/get_model_info": lambda: (200, service.model_info()), "/model_info": lambda: (200, service.model_info()),
        "/get_server_info": lambda: (200, service.server_info()), "/server_info": lambda: (200, service.server_info()),
        "/flush_cache": lambda: (200, "Cache flushed."),
    }
    return Routes(gets=gets, posts=posts, max_body_bytes=service.limits.max_body_bytes, error=error_shape,
                  shapes={"/update_weights_from_disk": update_error_shape}, metrics=service.metrics)


def build_service(model_dir: str | Path, *, backend: str = "local", seed: int = 0, weight_version: str = "default",
                  max_wait_s: float = 0.005, max_batch_rows: int = 256, weights_root: str | Path | None = None,
                  scheduler: str = "auto", **limits: Any) -> RolloutService:
    """Load the tokenizer and build the named rollout backend through the plugin registry.

    ``limits``: max_new_tokens, max_prompts, max_body_bytes (None keeps the default).
    """
    from transformers import AutoTokenizer

    from rlctl.contracts.types import RolloutContext
    from rlctl.hooks.manager import load_plugins
    from rlctl.models.load import check_model_dir
    from rlctl.models.tokenizer import tokenizer_hash

    root = check_model_dir(model_dir)
    if weights_root is not None and not Path(weights_root).is_dir():
        raise RoleError(f"--weights-root {weights_root} is not a directory", "create it or pass another one")
    tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    try:
        bounds = default_limits(_read_config(root), tokenizer, **limits)
    except ValueError as err:
        raise RoleError(str(err), "pass a positive value") from None
    ctx = RolloutContext(model_dir=str(root), tokenizer_hash=tokenizer_hash(root), seed=seed)
    engine = load_plugins().build("rollout_backend", backend, {}, "serve --backend", ctx=ctx)
    return RolloutService(engine, tokenizer, str(root), backend=backend, weight_version=weight_version,
                          max_wait_s=max_wait_s, max_batch_rows=max_batch_rows, limits=bounds,
                          weights_root=weights_root, scheduler=scheduler)


def serve(service: RolloutService, host: str, port: int, *, http: HttpOptions | None = None, verbose: bool = False,
          ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT / SIGTERM; ``ready(url)`` is called once the socket listens."""
    try:
        server = RolloutServer(service, host, port, http=http, verbose=verbose)
    except RlctlError:
        service.close()
        raise
    serve_until_signal(server, ready)
