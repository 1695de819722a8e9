"""``rlctl serve reward``: a sequence-classification reward model (scalar head) over HTTP, batching requests.

Routes:

    POST /score              {"text": str | [str]}  or  {"prompt": str | [str], "response": str | [str]}
                             -> {"scores": [float | null, ...], "model_hash": str, "latency_s": float}
    GET /health              200 while the model thread is alive
    GET /health_score        200 once a real one-text forward pass finished in time, else 503
    GET /info, /model_info, /get_model_info
                             model path, ``model_hash`` (weights, config, tokenizer, how pairs are
                             encoded), architecture, limits
    GET /server_info, /get_server_info
                             batching counters
    GET /metrics             Prometheus text: requests and errors by route and status, latency,
                             forward-pass rows and time, queue depth, model_hash

Errors (every refusal, on every route) are ``{"error": "message"}`` with a 4xx or 5xx status.

A prompt/response pair is scored as one sequence: with the tokenizer's chat
template as ``[user: prompt, assistant: response]`` (its text tokenized as is:
the template adds any BOS), else ``prompt + response`` as plain text (with the
tokenizer's usual special tokens, like ``text``). The score is the model's single logit at the last
token (``AutoModelForSequenceClassification``, ``num_labels = 1``); a
non-finite score is ``null``, never a number.

Batching (rlctl.serve.score_worker): one thread owns the model; concurrent
requests that arrive within ``max_wait_s`` of each other share forward
passes of at most ``max_batch_rows`` sequences (right-padded; the model
pools at the last non-pad token). When a shared forward pass fails, each
request is re-run alone, so only the one that fails gets the error. A
request whose client left is dropped before its next forward pass.

Hardening is ``serve rollout``'s, from the same code (rlctl.serve.asgi and
rlctl.serve.listener on uvicorn + Starlette): API key, loopback trust rules,
body limits, strict JSON, request deadlines, connection limits, clean
shutdown on SIGTERM / SIGINT. Request limits
(sequences per request, characters, tokens against the model's positions,
types) are checked while parsing, before anything reaches the model thread:
a 400 naming the field.

What this is not: a trainer for reward models, or a production server.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from rlctl.contracts.errors import ModelError, RlctlError, RoleError
from rlctl.serve.http_common import ApiError, Cancelled, GetRoute, HttpOptions, PostRoute, Routes, json_repr
from rlctl.serve.listener import HttpServer, serve_until_signal
from rlctl.serve.score_worker import ScoreStats, ScoreWorker  # noqa: F401 - part of this module's API

HASH_VERSION = "1"  # bump when what model_hash covers changes
_KEYS = ("text", "prompt", "response")


@dataclass(frozen=True, slots=True)
class ScoreLimits:
    """What one /score request may ask for; checked while parsing.

    ``positions`` comes from the model's config; the rest are server settings
    (``rlctl serve reward --max-...``), reported by ``/info`` under ``limits``.
    """

    positions: int  # tokens per scored sequence
    max_texts: int = 256  # sequences per request
    max_body_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        for name in ("positions", "max_texts", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"limit {name} must be at least 1, got {getattr(self, name)}")

    @property
    def max_chars(self) -> int:
        return self.positions * 64  # no tokenizer packs more than 64 characters into a token

    def to_dict(self) -> dict[str, int]:
        return {"max_body_bytes": self.max_body_bytes, "max_texts_per_request": self.max_texts,
                "max_tokens": self.positions, "max_chars": self.max_chars}


def _strings(body: dict[str, Any], key: str, limits: ScoreLimits, *, empty_ok: bool) -> tuple[list[str], bool]:
    value = body[key]
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(t, str) for t in items):
        raise ApiError(400, f"{key} must be a string or a non-empty list of strings, got {json_repr(value)}")
    if len(items) > limits.max_texts:
        raise ApiError(400, f"{key} has {len(items)} entries; this server scores at most {limits.max_texts} "
                            "per request: split it")
    for k, t in enumerate(items):
        where = key if isinstance(value, str) else f"{key}[{k}]"
        if not t and not empty_ok:
            raise ApiError(400, f"{where} is empty")
        if len(t) > limits.max_chars:
            raise ApiError(400, f"{where} has {len(t)} characters, far more than the model's {limits.positions} "
                                "positions hold")
    return items, isinstance(value, str)


def parse_score(body: Any, encode: Callable[[str, str | None], list[int]], limits: ScoreLimits) -> list[list[int]]:
    """Token ids of every sequence a /score body asks for; ``encode(prompt_or_text, response_or_None)``.

    Every type, count and length is checked here, so a request the model
    would fail on is a 400 naming the field and never joins a batch.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    unknown = sorted(k for k in body if k not in _KEYS)
    if unknown:
        raise ApiError(400, f"unknown field `{json_repr(unknown[0])[1:-1]}`, expected text, or prompt and response")
    if ("text" in body) == ("prompt" in body or "response" in body):
        raise ApiError(400, "send either text, or prompt and response")
    if "text" in body:
        texts, single = _strings(body, "text", limits, empty_ok=False)
        pairs: list[tuple[str, str | None]] = [(t, None) for t in texts]
        names = ["text" if single else f"text[{k}]" for k in range(len(texts))]
    else:
        if "prompt" not in body or "response" not in body:
            raise ApiError(400, "prompt and response go together: send both")
        prompts, single = _strings(body, "prompt", limits, empty_ok=True)
        responses, _ = _strings(body, "response", limits, empty_ok=True)
        if len(prompts) != len(responses) or isinstance(body["prompt"], str) != isinstance(body["response"], str):
            raise ApiError(400, f"prompt and response must both be strings or lists of the same length "
                                f"(got {len(prompts)} and {len(responses)})")
        pairs = list(zip(prompts, responses))
        names = ["prompt + response" if single else f"prompt[{k}] + response[{k}]" for k in range(len(pairs))]
    rows = []
    for (first, second), name in zip(pairs, names):
        if second is not None and not first and not second:
            raise ApiError(400, f"{name} is empty")
        ids = encode(first, second)
        if not ids:
            raise ApiError(400, f"{name} tokenizes to no tokens")
        if len(ids) > limits.positions:
            raise ApiError(400, f"{name} is {len(ids)} tokens; the reward model has {limits.positions} positions")
        rows.append(ids)
    return rows


# -- the service ---------------------------------------------------------------------------------


class RewardService:
    """The routes' logic over one reward model, independent of HTTP plumbing."""

    def __init__(self, model: Any, tokenizer: Any, model_dir: str, *, max_wait_s: float = 0.005,
                 max_batch_rows: int = 64, limits: ScoreLimits | None = None) -> None:
        import torch

        self.model, self.tokenizer, self.model_dir = model, tokenizer, model_dir
        self._torch = torch
        self._config = json.loads((Path(model_dir) / "config.json").read_text())
        self.limits = limits or ScoreLimits(positions=positions_of(self._config))
        self.pad_id = int(model.config.pad_token_id)
        self.template = getattr(tokenizer, "chat_template", None) or None
        self._tokenizer_lock = threading.Lock()
        self.model_hash = model_hash(model, model_dir, self.template)
        from rlctl.serve.metrics import ServeMetrics

        self.metrics = ServeMetrics(collect=self._families)
        self.worker = ScoreWorker(self._forward, max_wait_s=max_wait_s, max_batch_rows=max_batch_rows,
                                  observe=self.metrics.observe_batch)

    def encode(self, first: str, second: str | None) -> list[int]:
        """Token ids of a text, or of a prompt/response pair (chat template when the tokenizer has one)."""
        with self._tokenizer_lock:
            if second is None:
                return list(self.tokenizer(first)["input_ids"])
            if self.template:
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": first}, {"role": "assistant", "content": second}], tokenize=False)
                return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            return list(self.tokenizer(first + second)["input_ids"])

    def _forward(self, rows: list[Sequence[int]]) -> list[float]:
        torch = self._torch
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        return [float(x) for x in logits[:, 0].float().tolist()]

    def score(self, body: Any, gone: Callable[[], bool] | None = None) -> tuple[int, Any]:
        started = time.perf_counter()
        rows = parse_score(body, self.encode, self.limits)
        scores = self.worker.score(rows, gone=gone)
        return 200, {"scores": [s if math.isfinite(s) else None for s in scores], "model_hash": self.model_hash,
                     "latency_s": round(time.perf_counter() - started, 6)}

    def health_score(self, timeout_s: float) -> tuple[int, Any]:
        """A real forward pass of one short text through the model thread, bounded by ``timeout_s``."""
        started = time.perf_counter()
        try:
            self.worker.score([self.encode("ok", None) or [self.pad_id]], timeout_s=timeout_s)
        except TimeoutError:
            raise ApiError(503, f"a one-text forward pass did not finish within {timeout_s:g}s") from None
        except Cancelled as err:
            raise ApiError(503, err.message) from None
        return 200, {"ok": True, "latency_s": round(time.perf_counter() - started, 4)}

    def info(self) -> dict[str, Any]:
        return {"model_path": self.model_dir, "model_hash": self.model_hash, "is_reward_model": True,
                "model_type": self._config.get("model_type"), "architectures": self._config.get("architectures"),
                "num_labels": 1, "pair_encoding": "chat_template" if self.template else "concatenate",
                "limits": {**self.limits.to_dict(), "max_batch_rows": self.worker.max_batch_rows}}

    def _families(self) -> list[Any]:
        """What /metrics reports of the model thread, read at scrape time."""
        from prometheus_client.core import InfoMetricFamily

        from rlctl.serve.metrics import worker_families

        worker = self.worker
        return [*worker_families(worker.stats, queue_depth=worker.queue_depth, busy=worker.busy, engine="model"),
                InfoMetricFamily("rlctl_reward_model", "The reward model being served",
                                 value={"model_hash": self.model_hash})]

    def server_info(self) -> dict[str, Any]:
        s = self.worker.stats
        return {"model_hash": self.model_hash, "max_batch_rows": self.worker.max_batch_rows,
                "rlctl": {"batches": s.batches, "requests": s.requests, "rows": s.rows,
                          "largest_batch_rows": s.largest_batch_rows,
                          "largest_batch_requests": s.largest_batch_requests, "retried_alone": s.retried_alone,
                          "cancelled": s.cancelled, "idle": self.worker.idle}}

    def close(self, timeout_s: float = 5.0) -> None:
        self.worker.close(timeout_s)


def positions_of(config: dict[str, Any]) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    text = config.get("text_config")
    return positions_of(text) if isinstance(text, dict) else 2048


def model_hash(model: Any, model_dir: str | Path, template: str | None) -> str:
    """What a score depends on: the weights (head included), the config, the tokenizer, how pairs are encoded."""
    from rlctl.models.fingerprint import fingerprint
    from rlctl.models.tokenizer import tokenizer_hash

    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.pop("transformers_version", None)
    parts = {"v": HASH_VERSION, "weights": fingerprint(model.state_dict()), "config": config,
             "tokenizer": tokenizer_hash(model_dir),
             "pairs": hashlib.sha256(template.encode()).hexdigest()[:16] if template else "concatenate"}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def load_reward_model(model_dir: str | Path) -> tuple[Any, Any, Path]:
    """(model, tokenizer, directory) of a local sequence-classification model with one label; ModelError otherwise."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from rlctl.models.load import check_model_dir

    hint = ("pass --model a directory written by save_pretrained of an AutoModelForSequenceClassification with "
            "num_labels=1 (a tiny one: `python scripts/make_reward_model.py DIR`)")
    try:
        root = check_model_dir(model_dir)
    except ModelError as err:
        raise ModelError(err.message, hint) from None
    try:
        config = AutoConfig.from_pretrained(root, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot read the config in {root}: {err}", hint) from None
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ModelError(f"{root} holds a {', '.join(archs)}, not a sequence-classification reward model", hint)
    if config.num_labels != 1:
        raise ModelError(f"{root} has a {config.num_labels}-label head; a reward model has one scalar output "
                         "(num_labels=1)", hint)
    try:
        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
        model, loading = AutoModelForSequenceClassification.from_pretrained(
            root, local_files_only=True, output_loading_info=True)
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"cannot load the reward model in {root}: {type(err).__name__}: {str(err)[:300]}",
                         hint) from None
    missing = sorted(loading.get("missing_keys") or [])
    if missing:
        raise ModelError(f"the weights in {root} lack {len(missing)} tensor(s) of the model, e.g. {missing[0]} "
                         "(they would be random): it is not a trained reward model", hint)
    if model.config.pad_token_id is None:
        if tokenizer.pad_token_id is None:
            raise ModelError(f"{root} defines no pad token, so requests cannot be batched",
                             "set pad_token_id in config.json (or a pad token in the tokenizer)")
        model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model, tokenizer, root


def build_reward_service(model_dir: str | Path, *, max_wait_s: float = 0.005, max_batch_rows: int = 64,
                         max_texts: int | None = None, max_body_bytes: int | None = None) -> RewardService:
    model, tokenizer, root = load_reward_model(model_dir)
    config = json.loads((root / "config.json").read_text())
    try:
        limits = ScoreLimits(positions=positions_of(config),
                             **{k: v for k, v in (("max_texts", max_texts), ("max_body_bytes", max_body_bytes))
                                if v is not None})
    except ValueError as err:
        raise RoleError(str(err), "pass a positive value") from None
    return RewardService(model, tokenizer, str(root), max_wait_s=max_wait_s, max_batch_rows=max_batch_rows,
                         limits=limits)


# -- HTTP --------------------------------------------------------------------------------------


def reward_routes(service: RewardService, http: HttpOptions) -> Routes:
    info: GetRoute = lambda: (200, service.info())  # noqa: E731
    server_info: GetRoute = lambda: (200, service.server_info())  # noqa: E731
    gets: dict[str, GetRoute] = {
        "/health": lambda: (200, None) if service.worker.alive else (503, None),
        "/health_score": lambda: service.health_score(http.health_timeout_s),
        "/info": info, "/model_info": info, "/get_model_info": info,
        "/server_info": server_info, "/get_server_info": server_info,
    }
    posts: dict[str, PostRoute] = {"/score": lambda body, gone: service.score(body, gone)}
    return Routes(gets=gets, posts=posts, max_body_bytes=service.limits.max_body_bytes, name="rlctl-serve-reward",
                  metrics=service.metrics)


class RewardServer(HttpServer):
    """A listening ``rlctl serve reward``: ``serve_forever()`` in one thread, ``shutdown()`` from another."""

    def __init__(self, service: RewardService, host: str, port: int, *, http: HttpOptions | None = None,
                 verbose: bool = False) -> None:
        http = http or HttpOptions()
        self.service = service
        super().__init__(reward_routes(service, http), host, port, http=http, verbose=verbose,
                         cancel=service.worker.cancel_all, close=lambda timeout_s: service.close(timeout_s),
                         risk="use the reward model")


def serve(service: RewardService, host: str, port: int, *, http: HttpOptions | None = None, verbose: bool = False,
          ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT / SIGTERM; ``ready(url)`` is called once the socket listens."""
    try:
        server = RewardServer(service, host, port, http=http, verbose=verbose)
    except RlctlError:
        service.close()
        raise
    serve_until_signal(server, ready)

