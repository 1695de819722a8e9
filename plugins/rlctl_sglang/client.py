"""A small HTTP client for one SGLang-API server (stdlib only, JSON in and out).

What this is: the calls the sglang rollout backend makes, each bounded by a
timeout, with errors that name the server: ``ServerError`` with ``status``
None when the server is unreachable (refused, reset, timed out) and the HTTP
status otherwise. Proxies are bypassed: rollout servers are addressed directly.

What this is not: retry policy (the backend decides) or an SGLang SDK.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

from rlctl.contracts.errors import RoleError
from rlctl.engine.faults import fault_site

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


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
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._info_path = "/model_info"  # SGLang's current route; /get_model_info is its deprecated alias

    def _call(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        base = fault_site("rollout.connect", self.url, server=self.url, path=path)  # a partition (injected)
        request = urllib.request.Request(base + path, data=data, method=method, headers=self._headers)
        try:
            with _OPENER.open(request, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
                kind = resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            try:
                parsed = json.loads(detail)
                detail = parsed.get("message") or parsed.get("error") or detail
            except (json.JSONDecodeError, AttributeError):
                pass
            raise ServerError(self.url, f"{method} {path} answered {err.code}: {detail}", err.code) from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as err:
            reason = getattr(err, "reason", err)
            raise ServerError(self.url, f"{method} {path} failed: {reason}", None) from None
        if "json" in kind and raw:
            return json.loads(raw)
        return raw.decode(errors="replace")

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
