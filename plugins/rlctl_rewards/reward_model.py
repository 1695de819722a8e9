"""The "reward_model" reward: score (prompt, response) with a learned reward model behind ``rlctl serve reward``.

What this is: a RewardFunction that POSTs each sample's prompt (the
trajectory's prompt tokens decoded with the policy's tokenizer, BOS and
padding left out: the prompt as the policy saw it, a rendered chat template
included) and response text to one of ``servers`` (``rlctl serve reward
--model DIR``) and returns the reward model's scalar score.

Failures are flagged, never a score of 0:

- one call is bounded by ``timeout_s``; an unreachable server, a timeout, a
  5xx, a 429 or a server now serving another model is retried on the next
  server after an exponential back-off (``backoff_s``, doubling, at most
  ``backoff_max_s``), up to ``retries`` extra attempts;
- past them the sample gets ``error_code`` "timeout:reward_model" (the last
  attempt timed out) or "grader_error:reward_model" (unreachable or failing),
  both of which the engine re-scores with a fresh grader
  (``faults.verifier_retries``) and otherwise drops with their whole group;
- a request the server refuses (4xx: too long for the model, a wrong API key)
  is "reward_model_refused" (a refused batch is re-sent sample by sample, so
  only the sample at fault is flagged) and a non-finite score
  "invalid_reward": verdicts about this sample, not retried.

Version: ``reward_model@1.0+<model_hash>``, where ``model_hash`` is what the
servers' ``/info`` report (weights with the head, config, tokenizer, pair
encoding). Every server must serve the same hash at startup, and every score
must come back with it, so the grader version (and with it the dataset
version, so a resume) always names the model that scored. The API key is read
from the environment variable ``api_key_env``, never from the config.

Batches: the engine grades a step's samples through ``score_batch``, which
sends ``batch_size`` samples per request; the server also batches concurrent
requests (``reward.workers`` grader processes, several trainers). A failed
request flags every sample in it.

What this is not: the server (rlctl.serve.reward).
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlctl import RewardResult, Trajectory
from rlctl.contracts.errors import ConfigError, RoleError
from rlctl.kit import server_urls

VERSION = "1.0"
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})

# model_hash per server list, as first seen in this process: a fresh grader built for a retry
# (faults.verifier_retries) keeps the run's grader version while the servers are down.
_SEEN: dict[tuple[str, ...], str] = {}
_SEEN_LOCK = threading.Lock()


class RewardModelOptions(BaseModel):
    """Options of the "reward_model" reward."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    servers: list[str] = Field(min_length=1, description="Base URLs of `rlctl serve reward` servers, e.g. "
                               "http://127.0.0.1:30100; samples go round robin, a failed call moves to the next.")
    api_key_env: str = Field("RLCTL_SERVE_API_KEY", description="Environment variable holding the servers' API key "
                             "(their --api-key); unset or empty: no key. The key never goes into the config.")
    timeout_s: float = Field(10.0, gt=0, le=600, description="Deadline of one HTTP call.")
    retries: int = Field(3, ge=0, le=20, description="Extra attempts per sample on infrastructure failures, each on "
                         "the next server; past them the sample is flagged (error_code), never scored 0.")
    backoff_s: float = Field(0.2, ge=0, le=60, description="Pause before the first retry; doubles each retry.")
    backoff_max_s: float = Field(5.0, ge=0, le=600, description="Longest pause between two attempts.")
    batch_size: int = Field(64, ge=1, le=4096, description="Samples per /score request when the engine grades a "
                            "batch (at most the server's --max-texts, default 256).")
    policy_tokenizer: str | None = Field(
        None, description="Tokenizer directory that decodes the trajectory's prompt tokens into the prompt text "
        "sent to the reward model; defaults to model.path (the built-in character tokenizer for the built-in model).")

    @field_validator("servers")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        return server_urls(urls, key="servers", example="http://127.0.0.1:30100")


class RewardModelReward:
    """The score of a reward model served by ``rlctl serve reward``, with retries and flagged failures."""

    name = "reward_model"

    def __init__(self, options: RewardModelOptions) -> None:
        self.options = options
        self._api_key = os.environ.get(options.api_key_env) or None
        self._tokenizer = _policy_tokenizer(options.policy_tokenizer)
        # BOS / padding frame the prompt for the policy; chat-template tokens (<|im_start|>) are its text
        self._framing = {t for t in (self._tokenizer.bos_token_id, self._tokenizer.pad_token_id) if t is not None}
        self._next = 0
        self._lock = threading.Lock()
        self.model_hash = self._model_hash()
        self.version = f"reward_model@{VERSION}+{self.model_hash}"

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["options"])  # type: ignore[misc]

    # -- startup ---------------------------------------------------------------------------

    def _model_hash(self) -> str:
        """The model_hash the servers report (each asked with retries and back-off).

        Servers that cannot be reached are skipped (their scores are checked
        against this hash when they come back); one that answers with an error
        is a startup error; servers that serve different models are refused.
        """
        key = tuple(self.options.servers)
        with _SEEN_LOCK:
            if key in _SEEN:
                return _SEEN[key]
        hashes, down = {}, []
        for url in self.options.servers:
            found = self._info_hash(url)
            if isinstance(found, str):
                hashes[url] = found
            else:
                down.append(f"{url} ({found.message})")
        if not hashes:
            raise RoleError(f"no reward model server answered after {1 + self.options.retries} attempt(s) each: "
                            + "; ".join(down),
                            "start one first: `rlctl serve reward --model DIR --port N`, and list its URL in "
                            "reward.components[].options.servers")
        if len(set(hashes.values())) > 1:
            shown = ", ".join(f"{u} -> {h}" for u, h in hashes.items())
            raise ConfigError(f"the reward model servers serve different models ({shown})",
                              "serve the same model directory on every server")
        value = next(iter(hashes.values()))
        with _SEEN_LOCK:
            _SEEN.setdefault(key, value)
        return value

    def _info_hash(self, url: str) -> Any:
        """The server's model_hash, or the CallError when it could not be reached; raises when it refuses."""
        from rlctl.kit import CallError, call_json

        last: CallError | None = None
        for attempt in range(1 + self.options.retries):
            if attempt:
                time.sleep(self._backoff(attempt))
            try:
                info = call_json(url, "GET", "/info", timeout_s=self.options.timeout_s, api_key=self._api_key)
            except CallError as err:
                if err.status is not None and err.status not in RETRIED_STATUSES:
                    hint = (f"set the server's API key in ${self.options.api_key_env}" if err.status == 401 else
                            "point reward.components[].options.servers at `rlctl serve reward` servers")
                    raise ConfigError(f"reward model server {url}: {err.message}", hint) from None
                last = err
                continue
            value = info.get("model_hash") if isinstance(info, dict) else None
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{url}/info has no model_hash: it is not an `rlctl serve reward` server",
                                  "point reward.components[].options.servers at `rlctl serve reward` servers")
            return value
        return last

    def _backoff(self, attempt: int) -> float:
        return min(self.options.backoff_s * (2 ** (attempt - 1)), self.options.backoff_max_s)

    # -- scoring ---------------------------------------------------------------------------

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        return self.score_batch([trajectory], [reference])[0]

    def score_batch(self, trajectories: Sequence[Trajectory], references: Sequence[str]) -> list[RewardResult]:
        """Scores of many samples, ``batch_size`` per request (the server batches them into forward passes)."""
        out: list[RewardResult] = []
        size = self.options.batch_size
        for start in range(0, len(trajectories), size):
            out += self._score_chunk(trajectories[start:start + size])
        return out

    def _score_chunk(self, trajectories: Sequence[Trajectory]) -> list[RewardResult]:
        from rlctl.kit import CallError, call_json

        started = time.perf_counter()
        n = len(trajectories)
        body = {"prompt": [self._tokenizer.decode([t for t in traj.prompt_tokens if t not in self._framing])
                           for traj in trajectories],
                "response": [traj.response_text for traj in trajectories]}
        servers = self.options.servers
        with self._lock:
            first = self._next
            self._next = (self._next + 1) % len(servers)
        failures: list[str] = []
        timed_out = False
        for attempt in range(1 + self.options.retries):
            if attempt:
                time.sleep(self._backoff(attempt))
            url = servers[(first + attempt) % len(servers)]
            try:
                answer = call_json(url, "POST", "/score", body, timeout_s=self.options.timeout_s,
                                   api_key=self._api_key)
            except CallError as err:
                if err.status is not None and err.status not in RETRIED_STATUSES:
                    if n > 1 and err.status not in (401, 403):  # one sample's problem: find it, score the rest
                        return [r for traj in trajectories for r in self._score_chunk([traj])]
                    return [self._flag("reward_model_refused", started, f"{url}: {err.message}", n)] * n
                timed_out = err.timed_out
                failures.append(f"{url}: {err.message}")
                continue
            timed_out = False
            scores = answer.get("scores") if isinstance(answer, dict) else None
            if not isinstance(scores, list) or len(scores) != n:
                failures.append(f"{url}: answered without {n} score(s) ({str(answer)[:80]})")
                continue
            if answer.get("model_hash") != self.model_hash:
                failures.append(f"{url}: now serves model {answer.get('model_hash')}, this run scores with "
                                f"{self.model_hash}")
                continue
            log = url + (f" after {attempt} retr{'y' if attempt == 1 else 'ies'}" if attempt else "")
            return [self._result(value, started, log, n) for value in scores]
        code = "timeout:reward_model" if timed_out else "grader_error:reward_model"
        log = f"{1 + self.options.retries} attempt(s) failed: " + "; ".join(failures)
        return [self._flag(code, started, log, n)] * n

    def _result(self, value: Any, started: float, log: str, n: int) -> RewardResult:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return self._flag("invalid_reward", started, f"{log}: non-finite score ({value!r})", n)
        return RewardResult(total=float(value), components={"reward_model": float(value)},
                            grader_version=self.version, latency_s=(time.perf_counter() - started) / n, log=log)

    def _flag(self, code: str, started: float, log: str, n: int = 1) -> RewardResult:
        return RewardResult(total=0.0, components={}, grader_version=self.version, error_code=code,
                            latency_s=(time.perf_counter() - started) / n, log=log[:1000])


def _policy_tokenizer(path: str | None) -> Any:
    from rlctl.kit import build_char_tokenizer

    if path is None:
        return build_char_tokenizer()
    from pathlib import Path

    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ConfigError(f"policy_tokenizer directory not found: {path}",
                          "set reward.components[].options.policy_tokenizer (or model.path) to a tokenizer directory")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot load the tokenizer in {path}: {err}",
                          "point policy_tokenizer at a Hugging Face tokenizer directory") from None
