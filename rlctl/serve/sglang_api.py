"""The subset of SGLang's native HTTP schema that ``rlctl serve rollout`` speaks.

What this is: request parsing and response building for ``POST /generate``
(SGLang 0.5.x shapes, see ENVIRONMENT.md section 5): ``input_ids`` or
``text``, one or a batch; ``sampling_params`` (one dict or one per row);
``return_logprob``; response objects ``{"text", "output_ids", "meta_info"}``
with ``output_token_logprobs = [[logprob, token_id, null], ...]`` and SGLang's
``finish_reason`` objects. Unknown sampling keys are refused like SGLang does;
known keys this engine cannot honour (penalties, min_p, grammars, stop token
ids, streaming, input logprobs) are refused with a message instead of being
silently ignored.

Logprob semantics (differs from SGLang on purpose): the returned logprob of a
token is log p under the distribution it was drawn from (temperature, then
top-k, then top-p; rlctl.algo.sampling), which is what the learner
recomputes. SGLang returns log_softmax(logits / temperature) before top-k /
top-p; the two agree when top_k is off and top_p = 1. ``/get_model_info``
reports which one a server uses (``rlctl.logprobs``).

What this is not: the HTTP server (rlctl.serve.server) or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rlctl.contracts.types import SamplingConfig, TerminalReason, Trajectory

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
    "min_new_tokens": (0,), "ignore_eos": (False,), "skip_special_tokens": (True,), "stop_token_ids": (None, []),
    "stop_regex": (None,), "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,),
    "logit_bias": (None, {}), "sampling_seed": (None,), "custom_params": (None,), "beam_width": (None,),
    "watermark": (None,), "choice": (None,),
}


class ApiError(Exception):
    """A request the server refuses; becomes ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True, slots=True)
class Row:
    """One sequence to generate."""

    input_ids: tuple[int, ...]
    sampling: SamplingConfig
    rid: str
    return_logprob: bool
    no_stop_trim: bool


@dataclass(frozen=True, slots=True)
class GenerateCall:
    rows: tuple[Row, ...]
    single: bool  # the request named one prompt (respond with one object, not a list)


def parse_generate(body: Any, tokenize: Any, next_rid: Any) -> GenerateCall:
    """Validate a /generate body; ``tokenize(text) -> ids``; ``next_rid() -> str`` for missing rids."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if body.get("stream"):
        raise ApiError(400, "stream=true is not supported by rlctl serve rollout; send stream=false")
    if body.get("logprob_start_len") not in (None, -1) or body.get("top_logprobs_num") not in (None, 0):
        raise ApiError(400, "only output-token logprobs are supported (logprob_start_len=-1, top_logprobs_num=0)")
    if body.get("token_ids_logprob") is not None:
        raise ApiError(400, "token_ids_logprob is not supported by rlctl serve rollout")
    prompts, single = _prompts(body, tokenize)
    n = len(prompts)
    params = _per_row(body.get("sampling_params", {}), n, "sampling_params", dict)
    logprob = _per_row(body.get("return_logprob", False), n, "return_logprob", bool)
    rids = _per_row(body.get("rid"), n, "rid", str) if body.get("rid") is not None else [None] * n
    rows = []
    for ids, p, lp, rid in zip(prompts, params, logprob, rids):
        sampling, copies, no_trim = parse_sampling(p)
        base = rid or next_rid()
        for k in range(copies):
            rows.append(Row(input_ids=ids, sampling=sampling, rid=base if copies == 1 else f"{base}-{k}",
                            return_logprob=lp, no_stop_trim=no_trim))
    return GenerateCall(rows=tuple(rows), single=single and len(rows) == 1)


def _prompts(body: Mapping[str, Any], tokenize: Any) -> tuple[list[tuple[int, ...]], bool]:
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise ApiError(400, "send exactly one of input_ids or text")
    if text is not None:
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "text must be a string or a non-empty list of strings")
        return [tuple(tokenize(t)) for t in texts], isinstance(text, str)
    single = isinstance(ids, list) and bool(ids) and all(isinstance(i, int) for i in ids)
    batch = [ids] if single else ids
    if not isinstance(batch, list) or not batch or not all(
            isinstance(row, list) and row and all(isinstance(i, int) and i >= 0 for i in row) for row in batch):
        raise ApiError(400, "input_ids must be a non-empty list of token ids or a list of such lists")
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


def parse_sampling(params: Mapping[str, Any]) -> tuple[SamplingConfig, int, bool]:
    """(SamplingConfig, n copies, no_stop_trim) from an SGLang ``sampling_params`` object."""
    unknown = sorted(set(params) - set(SGLANG_SAMPLING_KEYS))
    if unknown:
        raise ApiError(400, f"unknown field `{unknown[0]}`, expected one of {', '.join(SGLANG_SAMPLING_KEYS)}")
    for key, allowed in _NEUTRAL.items():
        if key in params and params[key] not in allowed:
            raise ApiError(400, f"sampling_params.{key}={params[key]!r} is not supported by rlctl serve rollout "
                                f"(allowed: {', '.join(map(repr, allowed))})")
    try:
        temperature = float(params.get("temperature", 1.0))
        top_p = float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", TOP_K_ALL))
        max_new = int(params.get("max_new_tokens", 128))
        n = int(params.get("n", 1))
    except (TypeError, ValueError) as err:
        raise ApiError(400, f"bad sampling_params: {err}") from None
    if temperature < 0 or not 0 < top_p <= 1 or max_new < 1 or n < 1:
        raise ApiError(400, "need temperature >= 0, 0 < top_p <= 1, max_new_tokens >= 1 and n >= 1")
    if top_k == 0 or top_k < -1:
        raise ApiError(400, "top_k must be -1 (disable) or at least 1")
    stop = params.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a string or a list of non-empty strings")
    greedy = temperature < 1e-6
    sampling = SamplingConfig(temperature=0.0 if greedy else temperature, top_p=top_p,
                              top_k=0 if top_k == -1 or top_k >= TOP_K_ALL else top_k, max_tokens=max_new, stop=stop)
    return sampling, n, bool(params.get("no_stop_trim", False))


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
