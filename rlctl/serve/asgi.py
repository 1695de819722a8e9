"""The Starlette app under both ``rlctl serve`` servers: admission, bodies, dispatch, answers, metrics.

What this is: ``build_app(routes, http, host)`` turns a server's ``Routes``
(plain functions returning ``(status, payload)``) into an ASGI app that
uvicorn serves (rlctl.serve.listener). In order, for every request:

1. ``_Guard`` (ASGI middleware) admits it before anything reads the body:
   one well-formed ``Host`` (a foreign one refused on loopback: DNS
   rebinding), no ``Origin`` (a web page), the API key when set (compared in
   constant time), and at most ``max_requests`` in progress (503 beyond).
   A refusal is an answer like any other: the connection stays usable, and
   h11 reads the refused body as that request's body, never as a request.
2. The body: ``Content-Length`` bounded (413), chunked refused (411),
   application/json only (415), read whole within ``read_timeout_s`` (408),
   strict JSON (rlctl.serve.http_common.strict_json, 400).
3. The route runs on a worker thread (its own capacity limiter), told
   through ``gone()`` when the client disconnects, so its work is cancelled.
   ``ApiError`` is its status; ``Cancelled`` a 503 (nothing when the client
   left); ``RlctlError`` a 400; anything else a 500 with the traceback on
   stderr, and the server keeps serving.
4. Every answer and refusal has the server's error shape
   (``Routes.error_body``) and is counted in ``/metrics`` by route and status.

What this is not: connection handling (uvicorn + h11: HTTP/1.1 parsing,
keep-alive, header deadlines, connection limits; rlctl.serve.listener) or a
route's logic.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import threading
import time
import traceback
from typing import Any, Callable

import anyio.to_thread
from anyio import CapacityLimiter
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from rlctl.contracts.errors import RlctlError
from rlctl.serve.http_common import ApiError, Cancelled, HttpOptions, Routes, host_name, is_loopback, strict_json

METRICS_PATH = "/metrics"


def render(status: int, payload: Any, headers: dict[str, str] | None = None) -> Response:
    """A route's ``(status, payload)``: JSON for objects, text for strings, empty for None."""
    if payload is None:
        return Response(b"", status, headers=headers, media_type="text/plain")
    if isinstance(payload, str):
        return Response(payload.encode(), status, headers=headers, media_type="text/plain; charset=utf-8")
    return Response(json.dumps(payload).encode(), status, headers=headers, media_type="application/json")


class _Guard:
    """Admission (trust, in-progress limit) and request metrics, before the route or its body is touched."""

    def __init__(self, app: Any, *, routes: Routes, http: HttpOptions, host: str, metrics: Any) -> None:
        self.app, self.routes, self.metrics = app, routes, metrics
        self.check_host = is_loopback(host)
        self.bind_name = host.strip("[]").lower()
        self.expected = f"Bearer {http.api_key}".encode("ascii") if http.api_key else None
        self.max_requests, self.in_progress = http.max_requests, 0
        self.known = set(routes.gets) | set(routes.posts) | ({METRICS_PATH} if routes.metrics is not None else set())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, seen = time.perf_counter(), {"status": 500}
        path = scope["path"]

        async def tracked(message: dict) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                status, message, headers = refusal
                return await render(status, self.routes.error_body(path, message), headers)(scope, receive, tracked)
            self.in_progress += 1
            if self.metrics is not None:
                self.metrics.in_progress.set(self.in_progress)
            try:
                await self.app(scope, receive, tracked)
            finally:
                self.in_progress -= 1
        finally:
            if self.metrics is not None:
                self.metrics.observe(path if path in self.known else "unmatched", scope["method"], seen["status"],
                                     time.perf_counter() - started)

    def _refusal(self, scope: dict) -> tuple[int, str, dict[str, str] | None] | None:
        headers: dict[bytes, list[bytes]] = {}
        for key, value in scope["headers"]:
            headers.setdefault(key, []).append(value)
        hosts = headers.get(b"host", [])
        name = host_name(hosts[0].decode("latin-1")) if len(hosts) == 1 else None
        if hosts and name is None:
            return 400, "the Host header must be one host name or address, with an optional port", None
        if self.check_host and name is not None and not (is_loopback(name.strip("[]")) or name == self.bind_name):
            return 403, "Host header names another site; this server answers only to localhost / loopback " \
                        "addresses", None
        if b"origin" in headers:
            return 403, "requests from web pages (with an Origin header) are refused", None
        if self.expected is not None:
            got = headers.get(b"authorization", [b""])
            if len(got) != 1 or not hmac.compare_digest(got[0], self.expected):
                return 401, "missing or wrong API key: send `Authorization: Bearer KEY`", {"WWW-Authenticate": "Bearer"}
        if self.in_progress >= self.max_requests:
            return 503, f"server busy: {self.max_requests} requests in progress; retry shortly", {"Retry-After": "1"}
        return None


async def _body(request: Request, routes: Routes, http: HttpOptions) -> Any:
    """The request's JSON body (None when it has none); ApiError for every refusal."""
    if "transfer-encoding" in request.headers:
        raise ApiError(411, "chunked request bodies are not accepted; send Content-Length")
    declared = {v.strip() for v in request.headers.get("content-length", "0").split(",")}
    length = int(declared.pop()) if len(declared) == 1 else 0  # h11 accepted it: digits, repeats all equal
    if length > routes.max_body_bytes:
        raise ApiError(413, f"body of {length} bytes is over this server's limit of {routes.max_body_bytes}")
    if length == 0:
        return None
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, got {kind[:60] or 'none'!r}")
    chunks, got = [], 0
    try:
        async with asyncio.timeout(http.read_timeout_s):
            async for chunk in request.stream():
                chunks.append(chunk)
                got += len(chunk)
    except TimeoutError:
        raise ApiError(408, f"body incomplete after {http.read_timeout_s:g}s ({got} of {length} bytes)") from None
    return strict_json(b"".join(chunks))


async def _watch_disconnect(request: Request, gone: threading.Event) -> None:
    """Set ``gone`` once the client closes its side (the body has been read; nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()


def _call(fn: Callable[[Callable[[], bool]], tuple[int, Any]],
          gone: threading.Event) -> tuple[int, Any, bool] | None:
    """Run a route on this worker thread: (status, payload, is_error_message), or None when the client left."""
    try:
        status, payload = fn(gone.is_set)
        return status, payload, False
    except ApiError as err:
        return err.status, err.message, True
    except Cancelled as err:
        return None if gone.is_set() else (503, err.message, True)
    except RlctlError as err:
        return 400, str(err), True
    except Exception as err:  # noqa: BLE001 - a bug: keep serving, report it, keep the traceback
        traceback.print_exc(file=sys.stderr)
        return 500, f"internal error: {type(err).__name__}: {str(err)[:300]}", True


def _endpoint(path: str, fn: Callable[..., tuple[int, Any]], post: bool, routes: Routes, http: HttpOptions,
              limiter: CapacityLimiter) -> Callable[[Request], Any]:
    """The Starlette endpoint of one route: body, then the route on a thread while watching for a disconnect."""
    async def endpoint(request: Request) -> Response:
        try:
            body = await _body(request, routes, http) if post else None
        except ApiError as err:
            close = {"Connection": "close"} if err.status == 408 else None  # the rest of it may never come
            return render(err.status, routes.error_body(path, err.message), close)
        except ClientDisconnect:
            return Response(b"", 499)  # nobody to answer
        gone = threading.Event()
        watcher = asyncio.ensure_future(_watch_disconnect(request, gone))
        call = (lambda g: fn(body if body is not None else {}, g)) if post else (lambda g: fn())
        try:
            answer = await anyio.to_thread.run_sync(_call, call, gone, limiter=limiter)
        finally:
            watcher.cancel()
        if answer is None:
            return Response(b"", 499)  # the client left: uvicorn sends nothing; /metrics counts a 499
        status, payload, is_error = answer
        return render(status, routes.error_body(path, payload) if is_error else payload)

    endpoint.__name__ = f"route{path.replace('/', '_')}"
    return endpoint


def _metrics_endpoint(registry: Any) -> Callable[[Request], Any]:
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(registry), 200, media_type=CONTENT_TYPE_LATEST)
    return metrics


def build_app(routes: Routes, http: HttpOptions, host: str) -> Starlette:
    """The ASGI app of one server (see the module docstring)."""
    limiter = CapacityLimiter(http.max_requests)
    table: list[Route] = []
    for path in sorted(set(routes.gets) | set(routes.posts)):
        methods = (["GET", "HEAD"] if path in routes.gets else []) + (["POST"] if path in routes.posts else [])
        get = _endpoint(path, routes.gets[path], False, routes, http, limiter) if path in routes.gets else None
        post = _endpoint(path, routes.posts[path], True, routes, http, limiter) if path in routes.posts else None

        async def either(request: Request, get: Any = get, post: Any = post) -> Response:
            return await (post if request.method == "POST" else get)(request)
        table.append(Route(path, either, methods=methods))
    if routes.metrics is not None:
        table.append(Route(METRICS_PATH, _metrics_endpoint(routes.metrics.registry), methods=["GET", "HEAD"]))

    async def refused(request: Request, exc: HTTPException) -> Response:  # 404 / 405 from the router
        what = {404: f"no route {request.url.path[:100]}", 405: f"{request.method} is not allowed on "
                f"{request.url.path[:100]}"}.get(exc.status_code, str(exc.detail))
        return render(exc.status_code, routes.error_body(request.url.path, what), dict(exc.headers or {}))

    guard = Middleware(_Guard, routes=routes, http=http, host=host, metrics=routes.metrics)
    return Starlette(routes=table, middleware=[guard], exception_handlers={HTTPException: refused})
