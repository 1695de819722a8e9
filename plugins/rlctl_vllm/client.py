"""A small HTTP client for one vLLM OpenAI-API server (stdlib only, JSON in and out).

What this is: the calls the vllm rollout backend makes, each one bounded
``rlctl.kit.call_json``: ``/v1/completions`` with token-id prompts,
``/pause``, ``/resume``, ``/collective_rpc`` (``reload_weights``),
``/weight_checker`` and ``/health``. The weight routes exist only when the
server runs with ``VLLM_SERVER_DEV_MODE=1``. Errors are ``ServerError``
naming the server (``status`` None when it could not be reached).

What this is not: retry policy (the backend decides) or a vLLM SDK.
"""

from __future__ import annotations

from typing import Any

from rlctl.contracts.errors import RoleError
from rlctl.kit import CallError, call_json, fault_site


class ServerError(RoleError):
    """A call to a vLLM server failed; ``status`` is None when the server could not be reached."""

    def __init__(self, url: str, message: str, status: int | None) -> None:
        super().__init__(f"vLLM server {url}: {message}",
                         "check that the server runs with VLLM_SERVER_DEV_MODE=1 and serves this model "
                         "(GET /v1/models); its log says why it failed")
        self.url, self.status = url, status

    @property
    def unreachable(self) -> bool:
        return self.status is None


class VLLMClient:
    """JSON over HTTP to one vLLM server."""

    def __init__(self, url: str, timeout_s: float, api_key: str | None = None) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self._api_key = api_key or None

    def _call(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        base = fault_site("rollout.connect", self.url, server=self.url, path=path)  # a partition (injected)
        try:
            return call_json(base, method, path, body, timeout_s=timeout_s or self.timeout_s, api_key=self._api_key)
        except CallError as err:
            raise ServerError(self.url, err.message, err.status) from None

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            self._call("GET", "/health", timeout_s=timeout_s)
        except ServerError:
            return False
        return True

    def model_id(self) -> str:
        """The served model's id (what ``model`` must name in a completion request)."""
        data = self._call("GET", "/v1/models").get("data") or []
        if not data:
            raise ServerError(self.url, "GET /v1/models lists no model", 200)
        return str(data[0]["id"])

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/completions", body)

    def pause(self) -> None:
        self._call("POST", "/pause?mode=wait")

    def resume(self) -> None:
        self._call("POST", "/resume")

    def reload_weights(self, weights_path: str) -> Any:
        return self._call("POST", "/collective_rpc", {"method": "reload_weights",
                                                      "kwargs": {"weights_path": weights_path}})

    def checksums(self) -> dict[str, str]:
        """Per-parameter sha256 of the served weights (computed in the workers), rank prefix stripped."""
        answer = self._call("POST", "/weight_checker", {"action": "checksum"})
        return {name.rsplit(":", 1)[-1]: digest for name, digest in (answer.get("checksums") or {}).items()}
