"""The subset of SGLang's native HTTP schema that ``rlctl serve rollout`` speaks.

What this is: request parsing and response building for ``POST /generate``
(SGLang 0.5.x shapes, see ENVIRONMENT.md section 5): ``input_ids`` or
``text``, one or a batch; ``sampling_params`` (one dict or one per row);
``return_logprob``; response objects ``{"text", "output_ids", "meta_info"}``
with ``output_token_logprobs = [[logprob, token_id, null], ...]`` and SGLang's
``finish_reason`` objects. Unknown keys are refused, at the top level and in
``sampling_params``, like SGLang's schema does (a typo such as
``sampling_param`` is a 400, not a request with default sampling); known
keys this engine cannot honour (penalties, min_p, grammars, stop token ids,
streaming, input logprobs, multimodal data, LoRA, sessions, ...) are refused
unless at their neutral value, with a message instead of being silently
ignored. ``weight_version`` (``check_weight_version``) is short printable
ASCII, because every generated row repeats it. Errors have SGLang's shape,
``{"error": {"message": ...}}`` (``error_shape``).

Logprob semantics (differs from SGLang on purpose): the returned logprob of a
token is log p under the distribution it was drawn from (temperature, then
top-k, then top-p; rlctl.algo.sampling), which is what the learner
recomputes. SGLang returns log_softmax(logits / temperature) before top-k /
top-p; the two agree when top_k is off and top_p = 1. ``/get_model_info``
reports which one a server uses (``rlctl.logprobs``).

What this is not: the HTTP server (rlctl.serve.server) or the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rlctl.contracts.types import SamplingConfig, TerminalReason, Trajectory
from rlctl.serve.http_common import ApiError, is_int, json_repr  # noqa: F401 - ApiError: part of this schema's API

TOP_K_ALL = 1 << 30  # SGLang's "top_k off"
LOGPROB_SEMANTICS = "sampled-distribution"  # temperature + top-k + top-p, as rlctl.algo.sampling

# Every key SGLang's SamplingParams accepts; an unknown key is a 400 there too.
SGLANG_SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
# Keys accepted only at their neutral value: (key, allowed values).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "min_p": (0, 0.0), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "min_new_tokens": (0,), "skip_special_tokens": (True,), "stop_token_ids": (None, []),
    "stop_regex": (None,), "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,),
    "logit_bias": (None, {}), "sampling_seed": (None,), "custom_params": (None,), "beam_width": (None,),
    "watermark": (None,), "choice": (None,),
}


# SGLang 0.5's GenerateReqInput fields besides the ones parsed below, each accepted only at a neutral value.
_GENERATE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "input_embeds": (None,), "image_data": (None,), "video_data": (None,), "audio_data": (None,),
    "return_text_in_logprobs": (None, False), "log_metrics": (None, True, False), "return_hidden_states": (None, False),
    "modalities": (None,), "session_params": (None,), "lora_path": (None,), "lora_id": (None,),
    "custom_logit_processor": (None,), "bootstrap_host": (None,), "bootstrap_port": (None,),
    "bootstrap_room": (None,), "bootstrap_pair_key": (None,), "data_parallel_rank": (None,),
    "background": (None, False), "conversation_id": (None,), "priority": (None,), "extra_key": (None,),
    "no_logs": (None, False), "custom_labels": (None,), "return_bytes": (None, False), "return_entropy": (None, False),
}
GENERATE_KEYS = ("text", "input_ids", "sampling_params", "return_logprob", "rid", "stream", "logprob_start_len",
                 "top_logprobs_num", "token_ids_logprob", *_GENERATE_NEUTRAL)
# SGLang's UpdateWeightFromDiskReqInput fields (the engine-level ones are accepted and have no effect here).
UPDATE_KEYS = ("model_path", "load_format", "weight_version", "flush_cache", "abort_all_requests", "is_async",
               "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "rid")
MAX_WEIGHT_VERSION_CHARS = 64


def error_shape(message: str) -> dict[str, Any]:
    """SGLang's error body (``_create_error_response``): ``{"error": {"message": ...}}``."""
    return {"error": {"message": message}}


def update_error_shape(message: str) -> dict[str, Any]:
    """``/update_weights_from_disk``'s body for a refusal, as SGLang answers it."""
    return {"success": False, "message": message, "num_paused_requests": 0}


def check_weight_version(value: Any) -> str:
    """A weight version as served: 1-64 printable ASCII characters (an integer is written in decimal).

    Every /generate row repeats it, so an unbounded one turns a small request into a huge answer.
    """
    if is_int(value) and 0 <= value < 10**18:
        return str(value)
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_WEIGHT_VERSION_CHARS or \
            any(not 0x21 <= ord(c) <= 0x7E for c in value):
        raise ApiError(400, f"weight_version must be 1-{MAX_WEIGHT_VERSION_CHARS} printable ASCII characters "
                            f"without spaces, or a non-negative integer, got {json_repr(value)}")
    return value


def unknown_key(body: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    """A 400 naming the first key of ``body`` not in ``known``."""
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise ApiError(400, f"unknown field `{json_repr(unknown[0])[1:-1]}` in {where}, expected one of "
                            f"{', '.join(known)}")


@dataclass(frozen=True, slots=True)
class Limits:
    """What one /generate request may ask for; checked while parsing, before anything reaches the engine.

    ``positions`` and ``vocab_size`` come from the served model's config; the
    rest are server settings (``rlctl serve rollout --max-...``), reported by
    ``/get_model_info`` under ``rlctl.limits``.
    """

    positions: int  # max_position_embeddings: prompt tokens + max_new_tokens must fit
    vocab_size: int  # every token id must be below it
    max_new_tokens: int = 1024  # cap on sampling_params.max_new_tokens (and positions - 1)
    max_prompts: int = 512  # rows per request, ``n`` copies included
    max_body_bytes: int = 8 << 20  # request body size
    ignore_eos: bool = False  # sampling_params.ignore_eos may be true (the served engine honours it)

    def __post_init__(self) -> None:
        for name in ("positions", "vocab_size", "max_new_tokens", "max_prompts", "max_body_bytes"):
            if getattr(self, name) < 1 or (name == "positions" and self.positions < 2):
                raise ValueError(f"limit {name} must be at least {2 if name == 'positions' else 1}, "
                                 f"got {getattr(self, name)}")

    @property
    def new_tokens_cap(self) -> int:
        return min(self.max_new_tokens, self.positions - 1)

    def to_dict(self) -> dict[str, int]:
        return {"max_body_bytes": self.max_body_bytes, "max_prompts_per_request": self.max_prompts,
                "max_new_tokens": self.new_tokens_cap, "max_positions": self.positions,
                "max_prompt_tokens": self.positions - 1, "vocab_size": self.vocab_size}


@dataclass(frozen=True, slots=True)
class Row:
    """One sequence to generate."""

    input_ids: tuple[int, ...]
    sampling: SamplingConfig
    rid: str
    return_logprob: bool
    no_stop_trim: bool
    ignore_eos: bool = False  # EOS does not end the row (it is kept in the response)


@dataclass(frozen=True, slots=True)
class GenerateCall:
    rows: tuple[Row, ...]
    single: bool  # the request named one prompt (respond with one object, not a list)


def parse_generate(body: Any, tokenize: Any, next_rid: Any, limits: Limits) -> GenerateCall:
    """Validate a /generate body; ``tokenize(text) -> ids``; ``next_rid() -> str`` for missing rids.

    Every rule of ``limits`` and every type is checked here, so a request the
    engine would fail on is a 400 naming the field, and a bad row never joins
    a batch with other clients' rows. Prompts are tokenized last, one at a
    time, each checked against its row's room at once: a request of many
    over-long texts costs one tokenization before its 400, not all of them.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    unknown_key(body, GENERATE_KEYS, "the /generate body")
    for key, allowed in _GENERATE_NEUTRAL.items():  # the allowed values are None / True / False: compare identity
        if key in body and not any(body[key] is value for value in allowed):
            raise ApiError(400, f"{key}={json_repr(body[key])} is not supported by rlctl serve rollout")
    if body.get("stream") not in (None, False):
        raise ApiError(400, "stream=true is not supported by rlctl serve rollout; send stream=false")
    if body.get("logprob_start_len") not in (None, -1) or body.get("top_logprobs_num") not in (None, 0):
        raise ApiError(400, "only output-token logprobs are supported (logprob_start_len=-1, top_logprobs_num=0)")
    if body.get("token_ids_logprob") is not None:
        raise ApiError(400, "token_ids_logprob is not supported by rlctl serve rollout")
    raw, single = _prompt_list(body, limits)
    n = len(raw)
    params = _per_row(body.get("sampling_params", {}), n, "sampling_params", dict)
    logprob = _per_row(body.get("return_logprob", False), n, "return_logprob", bool)
    rids = _per_row(body.get("rid"), n, "rid", str) if body.get("rid") is not None else [None] * n
    parsed = [parse_sampling(p, limits) for p in params]
    total = sum(copies for _, copies, _, _ in parsed)
    if total > limits.max_prompts:
        raise ApiError(400, f"the request asks for {total} sequences (prompts x n); this server takes at most "
                            f"{limits.max_prompts} per request: split it")
    rows = []
    for k, (prompt, (sampling, copies, no_trim, no_eos), lp, rid) in enumerate(zip(raw, parsed, logprob, rids)):
        where = ("text" if "text" in body else "prompt") if single else f"{'text' if 'text' in body else 'prompt'}[{k}]"
        room = limits.positions - sampling.max_tokens
        ids = _tokens(prompt, tokenize, room, where)
        if len(ids) > room:
            raise ApiError(400, f"{where} has {len(ids)} tokens; with max_new_tokens={sampling.max_tokens} "
                                f"at most {room} fit in the model's {limits.positions} positions")
        base = rid or next_rid()
        for c in range(copies):
            rows.append(Row(input_ids=ids, sampling=sampling, rid=base if copies == 1 else f"{base}-{c}",
                            return_logprob=lp, no_stop_trim=no_trim, ignore_eos=no_eos))
    return GenerateCall(rows=tuple(rows), single=single and len(rows) == 1)


def _tokens(prompt: str | tuple[int, ...], tokenize: Any, room: int, where: str) -> tuple[int, ...]:
    if not isinstance(prompt, str):
        return prompt
    if len(prompt) > room * 64:  # no tokenizer packs more than 64 characters into a token
        raise ApiError(400, f"{where} has {len(prompt)} characters, far more than the {room} prompt tokens that "
                            "fit in the model's positions")
    tokens = tuple(tokenize(prompt))
    if not tokens:
        raise ApiError(400, f"{where} tokenizes to no tokens")
    return tokens


def _prompt_list(body: Mapping[str, Any], limits: Limits) -> tuple[list[str | tuple[int, ...]], bool]:
    """The prompts as texts (tokenized later) or checked token ids, and whether the request named one."""
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise ApiError(400, "send exactly one of input_ids or text")
    if text is not None:
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "text must be a string or a non-empty list of strings")
        if len(texts) > limits.max_prompts:
            raise ApiError(400, f"text has {len(texts)} prompts; this server takes at most {limits.max_prompts} "
                                "per request: split it")
        for k, t in enumerate(texts):
            if not t:
                raise ApiError(400, "text must not be empty" if isinstance(text, str) else f"text[{k}] is empty")
        return list(texts), isinstance(text, str)
    single = isinstance(ids, list) and bool(ids) and not isinstance(ids[0], list)
    batch = [ids] if single else ids
    if not isinstance(batch, list) or not batch:
        raise ApiError(400, "input_ids must be a non-empty list of token ids or a list of such lists")
    if len(batch) > limits.max_prompts:
        raise ApiError(400, f"input_ids has {len(batch)} prompts; this server takes at most {limits.max_prompts} "
                            "per request: split it")
    for k, row in enumerate(batch):
        where = "input_ids" if single else f"input_ids[{k}]"
        if not isinstance(row, list) or not row:
            raise ApiError(400, f"{where} must be a non-empty list of token ids")
        if len(row) > limits.positions:
            raise ApiError(400, f"{where} has {len(row)} tokens; the model has {limits.positions} positions")
        for i in row:
            if not is_int(i) or not 0 <= i < limits.vocab_size:
                raise ApiError(400, f"{where} holds {json_repr(i)}; token ids are integers in "
                                    f"[0, {limits.vocab_size}) for this model")
    return [tuple(row) for row in batch], single


def _per_row(value: Any, n: int, name: str, kind: type) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ApiError(400, f"{name} has {len(value)} entries for {n} prompts")
        items = value
    else:
        items = [value] * n
    for item in items:
        if not isinstance(item, kind):
            raise ApiError(400, f"{name} must be a {kind.__name__} or a list of them, got {type(item).__name__}")
    return items


def _number(params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"sampling_params.{key} must be a number, got {json_repr(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ApiError(400, f"sampling_params.{key} must be finite, got {value}")
    return value


def _integer(params: Mapping[str, Any], key: str, default: int) -> int:
    value = params.get(key, default)
    if not is_int(value):
        raise ApiError(400, f"sampling_params.{key} must be an integer, got {json_repr(value)}")
    return value


def parse_sampling(params: Mapping[str, Any], limits: Limits) -> tuple[SamplingConfig, int, bool, bool]:
    """(SamplingConfig, n copies, no_stop_trim, ignore_eos) from an SGLang ``sampling_params`` object."""
    unknown = sorted(set(params) - set(SGLANG_SAMPLING_KEYS))
    if unknown:
        raise ApiError(400, f"unknown field `{json_repr(unknown[0])[1:-1]}`, expected one of "
                            f"{', '.join(SGLANG_SAMPLING_KEYS)}")
    for key, allowed in _NEUTRAL.items():
        if key in params and (isinstance(params[key], bool) != isinstance(allowed[0], bool)
                              or params[key] not in allowed):
            raise ApiError(400, f"sampling_params.{key}={json_repr(params[key])} is not supported by rlctl serve "
                                f"rollout (allowed: {', '.join(map(repr, allowed))})")
    temperature, top_p = _number(params, "temperature", 1.0), _number(params, "top_p", 1.0)
    top_k, n = _integer(params, "top_k", TOP_K_ALL), _integer(params, "n", 1)
    max_new = _integer(params, "max_new_tokens", min(128, limits.new_tokens_cap))
    if temperature < 0:
        raise ApiError(400, f"sampling_params.temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ApiError(400, f"sampling_params.top_p must be in (0, 1], got {top_p}")
    if not 1 <= max_new <= limits.new_tokens_cap:
        raise ApiError(400, f"sampling_params.max_new_tokens must be in [1, {limits.new_tokens_cap}] on this "
                            f"server, got {max_new}")
    if not 1 <= n <= limits.max_prompts:
        raise ApiError(400, f"sampling_params.n must be in [1, {limits.max_prompts}], got {n}")
    if top_k == 0 or top_k < -1:
        raise ApiError(400, f"sampling_params.top_k must be -1 (disable) or at least 1, got {top_k}")
    stop = params.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise ApiError(400, "sampling_params.stop must be a non-empty string or a list of at most 16 of them")
    no_trim = params.get("no_stop_trim", False)
    if not isinstance(no_trim, bool):
        raise ApiError(400, f"sampling_params.no_stop_trim must be true or false, got {json_repr(no_trim)}")
    ignore_eos = params.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, f"sampling_params.ignore_eos must be true or false, got {json_repr(ignore_eos)}")
    if ignore_eos and not limits.ignore_eos:
        raise ApiError(400, "sampling_params.ignore_eos=true is not supported by this server's rollout backend "
                            "(the local engine supports it)")
    greedy = temperature < 1e-6
    sampling = SamplingConfig(temperature=0.0 if greedy else temperature, top_p=top_p,
                              top_k=0 if top_k == -1 or top_k >= TOP_K_ALL else top_k, max_tokens=max_new,
                              stop=tuple(stop))
    return sampling, n, no_trim, ignore_eos


def finish_reason(traj: Trajectory, eos_id: int) -> tuple[dict[str, Any], str | None]:
    """SGLang's finish_reason object for ``traj``, and the stop string that matched (if any)."""
    reason = traj.terminal_reason
    if reason == TerminalReason.EOS:
        return {"type": "stop", "matched": eos_id}, None
    if reason == TerminalReason.STOP:
        matched = next((s for s in traj.sampling_config.stop if traj.response_text.endswith(s)), None)
        return {"type": "stop", "matched": matched}, matched
    if reason == TerminalReason.LENGTH:
        return {"type": "length", "length": traj.num_response_tokens}, None
    return {"type": "abort", "message": "aborted by the engine", "status_code": None, "err_type": None}, None


def response_item(row: Row, traj: Trajectory, *, eos_id: int, weight_version: str, latency_s: float) -> dict[str, Any]:
    """One SGLang /generate response object."""
    reason, matched = finish_reason(traj, eos_id)
    text = traj.response_text
    if matched and not row.no_stop_trim:
        text = text[: len(text) - len(matched)]
    meta: dict[str, Any] = {
        "id": row.rid, "finish_reason": reason, "prompt_tokens": len(row.input_ids),
        "completion_tokens": traj.num_response_tokens, "cached_tokens": 0, "weight_version": weight_version,
        "e2e_latency": latency_s,
    }
    if row.return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(traj.behavior_logprobs,
                                                                             traj.response_tokens)]
        meta["input_token_logprobs"] = []
        meta["output_top_logprobs"] = []
        meta["input_top_logprobs"] = []
    return {"text": text, "output_ids": list(traj.response_tokens), "meta_info": meta}


def generate_response(call: GenerateCall, items: Sequence[dict[str, Any]]) -> Any:
    return items[0] if call.single else list(items)
