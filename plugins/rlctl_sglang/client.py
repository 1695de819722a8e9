"""A small HTTP client for one SGLang-API server (stdlib only, JSON in and out).

What this is: the calls the sglang rollout backend makes, each bounded by a
timeout (one ``rlctl.kit.call_json`` each), with errors that name the
server: ``ServerError`` with ``status`` None when the server is unreachable
(refused, reset, timed out) and the HTTP status otherwise. Proxies are
bypassed: rollout servers are addressed directly.

What this is not: retry policy (the backend decides) or an SGLang SDK.
"""

from __future__ import annotations

from typing import Any

from rlctl.contracts.errors import RoleError
from rlctl.kit import CallError, call_json, fault_site


class ServerError(RoleError):
    """A call to a rollout server failed; ``status`` is None when the server could not be reached."""

    def __init__(self, url: str, message: str, status: int | None) -> None:
        super().__init__(f"rollout server {url}: {message}",
                         "check that the server runs and serves this model (GET /get_model_info)")
        self.url, self.status = url, status

    @property
    def unreachable(self) -> bool:
        return self.status is None


class ServerClient:
    """JSON over HTTP to one server; ``api_key`` is sent as ``Authorization: Bearer KEY`` (SGLang's --api-key)."""

    def __init__(self, url: str, timeout_s: float, api_key: str | None = None) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self._api_key = api_key or None
        self._info_path = "/model_info"  # SGLang's current route; /get_model_info is its deprecated alias

    def _call(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        base = fault_site("rollout.connect", self.url, server=self.url, path=path)  # a partition (injected)
        try:
            return call_json(base, method, path, body, timeout_s=timeout_s or self.timeout_s,
                             api_key=self._api_key)
        except CallError as err:
            raise ServerError(self.url, err.message, err.status) from None

    def model_info(self, timeout_s: float | None = None) -> dict[str, Any]:
        try:
            return self._call("GET", self._info_path, timeout_s=timeout_s)
        except ServerError as err:
            if err.status != 404 or self._info_path == "/get_model_info":
                raise
            self._info_path = "/get_model_info"  # an older server
            return self._call("GET", self._info_path, timeout_s=timeout_s)

    def server_info(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self._call("GET", "/get_server_info", timeout_s=timeout_s)

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            self._call("GET", "/health", timeout_s=timeout_s)
        except ServerError:
            return False
        return True

    def generate(self, body: dict[str, Any]) -> Any:
        return self._call("POST", "/generate", body)

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> dict[str, Any]:
        return self._call("POST", "/update_weights_from_disk",
                          {"model_path": model_path, "weight_version": weight_version, "flush_cache": True})

    def flush_cache(self) -> str:
        return self._call("POST", "/flush_cache")
