"""One bounded JSON-over-HTTP call to an ``rlctl serve`` (or SGLang) server, stdlib only.

What this is: ``call_json``, used by the clients of the servers (the sglang
rollout plugin, the reward_model reward). Every failure is a ``CallError``
naming the URL and route: ``status`` None when the server could not be
reached or did not answer in time (``timed_out``), the HTTP status otherwise,
with the server's message (``{"error": {"message": ...}}`` as SGLang and
``rlctl serve rollout`` answer, ``{"error": ...}``, or ``{"message": ...}``). Proxies are bypassed: servers are
addressed directly.

What this is not: retry policy (each caller decides) or an SDK.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any

from rlctl.contracts.errors import RoleError
from rlctl.serve.http_common import check_api_key

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def server_urls(urls: list[str], *, key: str, example: str) -> list[str]:
    """Validate a config's server list: http(s) URLs, each once; returned without trailing slashes."""
    out = []
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"server {url!r} must be an http(s) URL such as {example}")
        out.append(url.rstrip("/"))
    if len(set(out)) != len(out):
        raise ValueError(f"a server is listed twice in {key}; list each once")
    return out


class CallError(RoleError):
    """A call failed; ``status`` is None when the server could not be reached (or timed out)."""

    def __init__(self, url: str, message: str, status: int | None, *, timed_out: bool = False,
                 hint: str | None = None) -> None:
        super().__init__(message, hint)
        self.url, self.status, self.timed_out = url, status, timed_out

    @property
    def unreachable(self) -> bool:
        return self.status is None


def call_json(url: str, method: str, path: str, body: Any = None, *, timeout_s: float,
              api_key: str | None = None) -> Any:
    """The decoded JSON answer (or text) of ``method url+path``; raises CallError."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {check_api_key(api_key)}"  # ASCII: the bytes every server compares
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method, headers=headers)
    try:
        with _OPENER.open(request, timeout=timeout_s) as resp:
            raw = resp.read()
            kind = resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        try:
            parsed = json.loads(detail)
            error = parsed.get("error")
            detail = parsed.get("message") or (error.get("message") if isinstance(error, dict) else error) or detail
        except (json.JSONDecodeError, AttributeError):
            pass
        raise CallError(url, f"{method} {path} answered {err.code}: {detail}", err.code) from None
    except (urllib.error.URLError, http.client.HTTPException, socket.timeout, TimeoutError, OSError) as err:
        reason = getattr(err, "reason", err)
        timed_out = isinstance(reason, (socket.timeout, TimeoutError)) or isinstance(err, (socket.timeout,
                                                                                           TimeoutError))
        raise CallError(url, f"{method} {path} failed: {reason}", None, timed_out=timed_out) from None
    if "json" in kind and raw:
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CallError(url, f"{method} {path} answered invalid JSON", 200) from None
    return raw.decode(errors="replace")
