"""What both ``rlctl serve`` servers share besides the HTTP stack: trust rules, options, body parsing, jobs.

What this is: the decisions, written once, that rlctl.serve.asgi (the
Starlette app) and rlctl.serve.listener (uvicorn) apply for ``rlctl serve
rollout`` and ``rlctl serve reward``:

- trust: ``check_api_key`` (ASCII, no whitespace, refused at start-up
  otherwise), ``check_exposure`` (no non-loopback bind without a key),
  ``host_name`` (one strict ``Host`` value, else refused: DNS rebinding);
- ``HttpOptions``: connection and request limits, timeouts;
- ``strict_json``: UTF-8, finite numbers, bounded nesting, no lone
  surrogates; every failure an ``ApiError`` 400;
- ``ApiError`` (a refusal with its status), ``Cancelled``, and ``await_job``
  / ``fail_queued`` for the work queues of both model threads.

What this is not: HTTP parsing, connections or routing (uvicorn's h11 and
Starlette do those; rlctl.serve.listener and rlctl.serve.asgi configure
them), or a route's schema (rlctl.serve.sglang_api, rlctl.serve.reward).
"""

from __future__ import annotations

import ipaddress
import json
import queue
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from rlctl.contracts.errors import RoleError

GetRoute = Callable[[], "tuple[int, Any]"]
PostRoute = Callable[[Any, Callable[[], bool]], "tuple[int, Any]"]  # (body, gone) -> (status, payload)


class ApiError(Exception):
    """A request the server refuses; rendered in the server's error shape with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Cancelled(RoleError):
    """The job was cancelled (its client left, or the server is shutting down) before it finished."""


def await_job(job: Any, *, gone: Callable[[], bool] | None, timeout_s: float | None, what: str) -> Any:
    """Wait for ``job.future`` while polling ``gone()``; a client that left or a deadline cancels the job.

    Raises ``Cancelled`` once ``gone()`` is true, TimeoutError past ``timeout_s``
    (``what`` names the work in its message); either way ``job.cancelled`` is set.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
        try:
            return job.future.result(timeout=wait)
        except TimeoutError:
            pass
        if gone is not None and gone():
            job.cancelled.set()
            raise Cancelled("the client closed the connection", "nothing to do")
        if deadline is not None and time.monotonic() >= deadline:
            job.cancelled.set()
            raise TimeoutError(f"{what} did not finish within {timeout_s:g}s")


def fail_queued(jobs: "queue.Queue[Any]", stop: Any, err: Exception) -> None:
    """Fail every job still waiting in ``jobs`` (skipping the ``stop`` sentinel) with ``err``: shutdown."""
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return
        if job is not stop and not job.future.done():
            job.future.set_exception(err)


def json_repr(value: Any) -> str:
    """A short rendering of a client value for an error message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_int(value: Any) -> bool:
    """A JSON integer (``true`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_api_key(api_key: str | None) -> str | None:
    """The key a server requires (None: none), or a RoleError naming the problem (one line, no traceback).

    ASCII without whitespace only: clients send it in a header, which
    travels as bytes whose encoding they do not agree on (latin-1 or UTF-8).
    """
    if api_key is None or api_key == "":
        return None
    if not api_key.strip():
        raise RoleError("the API key is blank (only whitespace)", "pass a real key with --api-key or "
                        "RLCTL_SERVE_API_KEY, or leave both unset to run on loopback without one")
    bad = next((c for c in api_key if not 0x21 <= ord(c) <= 0x7E), None)
    if bad is not None:
        raise RoleError(f"the API key holds {bad!r}; keys are printable ASCII without spaces",
                        "generate one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    return api_key


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpOptions:
    """Connection handling and trust settings of one server."""

    api_key: str | None = None  # every route needs `Authorization: Bearer KEY` when set
    max_connections: int = 512  # open connections; requests on connections past it get 503
    max_requests: int = 64  # requests being read or worked on at once; more get 503 at once
    read_timeout_s: float = 10.0  # a request's head, or its body, must arrive within this; idle keep-alive ends
    backlog: int = 1024  # listen queue
    health_timeout_s: float = 20.0  # bound on a health route's real model call

    def __post_init__(self) -> None:
        check_api_key(self.api_key)
        if min(self.max_connections, self.max_requests, self.backlog) < 1 or min(self.read_timeout_s,
                                                                                  self.health_timeout_s) <= 0:
            raise ValueError("max_connections, max_requests and backlog must be >= 1, timeouts > 0")


def is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, risk: str = "swap the served weights") -> None:
    """Refuse to listen beyond this machine without an API key (and refuse keys that cannot work)."""
    if not is_loopback(host) and not check_api_key(api_key):
        raise RoleError(f"refusing to serve on {host} without --api-key (anyone who can reach it could {risk}); "
                        "set --api-key or RLCTL_SERVE_API_KEY, or bind 127.0.0.1")


_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}))(?::[0-9]{1,5})?")


def host_name(value: str) -> str | None:
    """The host name of one ``Host`` header value (lower case, no port); None when it is not one host[:port]."""
    match = _HOST.fullmatch(value.strip())
    return match.group(1).lower() if match else None


def strict_json(raw: bytes) -> Any:
    """Parse a request body: UTF-8, finite numbers only, bounded nesting, valid Unicode; else ``ApiError`` 400."""
    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON (numbers must be finite)")

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ApiError(400, f"body is not UTF-8: byte {err.start} is invalid") from None
    try:
        value = json.loads(text, parse_constant=no_constant)
    except RecursionError:
        raise ApiError(400, "body is not JSON this server accepts: nested too deeply") from None
    except ValueError as err:  # JSONDecodeError, NaN/Infinity, integers with too many digits
        raise ApiError(400, f"body is not valid JSON: {str(err)[:200]}") from None
    if "\\u" in text or "\\U" in text:  # an escape could spell a lone surrogate, which no text encoding holds
        _check_unicode(value)
    return value


def _check_unicode(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ApiError(400, f"body holds a lone surrogate ({item[err.start]!r}) in a string: escapes "
                                    "\\ud800-\\udfff must come in valid pairs") from None
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())


@dataclass(frozen=True)
class Routes:
    """What one server answers: GET and POST handlers by path, its body limit, error shape and metrics.

    ``error(message)`` is the JSON body of every refusal and failure (the
    server's documented error shape); ``shapes`` overrides it per path.
    ``metrics`` is the server's prometheus_client registry, served at
    ``/metrics`` (None: no such route).
    """

    gets: Mapping[str, GetRoute]
    posts: Mapping[str, PostRoute]
    max_body_bytes: int
    name: str = "rlctl-serve"  # the Server header
    error: Callable[[str], Any] = lambda message: {"error": message}
    shapes: Mapping[str, Callable[[str], Any]] | None = None
    metrics: Any = None

    def error_body(self, path: str, message: str) -> Any:
        shape = (self.shapes or {}).get(path, self.error)
        return shape(message)
