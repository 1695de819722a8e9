"""The hardening every ``rlctl serve`` server shares: trust, parse-time body checks, bounded threads, shutdown.

What this is: the HTTP plumbing under ``rlctl serve rollout`` (rlctl.serve.server)
and ``rlctl serve reward`` (rlctl.serve.reward), written once. A server hands
``HttpServer`` its routes (``Routes``: GET and POST handlers returning
``(status, payload)``) and gets:

- trust: with ``api_key`` every route needs ``Authorization: Bearer KEY``
  (401 otherwise, compared in constant time); binding a non-loopback address
  without a key is refused (``check_exposure``); on loopback a foreign
  ``Host`` is refused (DNS rebinding), any ``Origin`` (a browser page) is
  refused, request bodies must be application/json;
- body checks before any route runs: Content-Length required and bounded
  (413), chunked bodies refused (411), the body read within the read timeout
  (408), strict UTF-8 JSON with finite numbers only (400), nesting bounded;
- one request failing alone: a route's ``ApiError`` is its status, an
  ``RlctlError`` a 400, anything else a 500 with the traceback on stderr, and
  the server keeps serving;
- bounded connection threads (503 past ``max_connections``), a listen
  backlog, socket read timeouts that close idle or stalled connections;
- clean shutdown: ``serve_until_signal`` stops on SIGTERM / SIGINT, calls the
  server's ``cancel`` (work stops at its next step), stops accepting and
  closes the socket within a few seconds.

What this is not: a route or a schema (those live with each server), or a
production web server.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping

from rlctl.contracts.errors import RlctlError, RoleError

GetRoute = Callable[[], "tuple[int, Any]"]
PostRoute = Callable[[Any, Callable[[], bool]], "tuple[int, Any]"]  # (body, gone) -> (status, payload)


class ApiError(Exception):
    """A request the server refuses; becomes ``{"error": message}`` with ``status``."""

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


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpOptions:
    """Connection handling and trust settings of one server."""

    api_key: str | None = None  # every route needs `Authorization: Bearer KEY` when set
    max_connections: int = 64  # connection threads; more concurrent connections get 503 at once
    read_timeout_s: float = 10.0  # an idle or stalled connection is closed after this
    backlog: int = 128  # listen queue
    health_timeout_s: float = 20.0  # bound on a health route's real model call

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty; leave it unset to run without one")
        if self.max_connections < 1 or self.backlog < 1 or self.read_timeout_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("max_connections and backlog must be >= 1, timeouts > 0")


@dataclass(frozen=True)
class Routes:
    """What one server answers: GET and POST handlers by path, and its request body limit."""

    gets: Mapping[str, GetRoute]
    posts: Mapping[str, PostRoute]
    max_body_bytes: int
    name: str = "rlctl-serve"  # the Server header


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, risk: str = "swap the served weights") -> None:
    """Refuse to listen beyond this machine without an API key."""
    if not is_loopback(host) and not api_key:
        raise RoleError(f"refusing to serve on {host} without --api-key (anyone who can reach it could {risk}); "
                        "set --api-key or RLCTL_SERVE_API_KEY, or bind 127.0.0.1")


class _Refused(Exception):
    """A request refused before its route runs; ``close`` when the rest of it was not read."""

    def __init__(self, status: int, message: str, close: bool = False, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.close, self.headers = status, message, close, dict(headers or {})


class _ClientGone(Exception):
    """The client closed the connection; there is nobody to answer."""


def strict_json(raw: bytes) -> Any:
    """Parse a request body: UTF-8, finite numbers only, bounded nesting; every failure an ``ApiError`` 400."""
    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON (numbers must be finite)")

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ApiError(400, f"body is not UTF-8: byte {err.start} is invalid") from None
    try:
        return json.loads(text, parse_constant=no_constant)
    except RecursionError:
        raise ApiError(400, "body is not JSON this server accepts: nested too deeply") from None
    except ValueError as err:  # JSONDecodeError, NaN/Infinity, integers with too many digits
        raise ApiError(400, f"body is not valid JSON: {str(err)[:200]}") from None


def make_handler(routes: Routes, http: HttpOptions, host: str, verbose: bool) -> type[BaseHTTPRequestHandler]:
    """The request handler class: admission (trust), body checks, dispatch to ``routes``, answers."""
    gets, posts = routes.gets, routes.posts
    check_host = is_loopback(host)
    expected_auth = f"Bearer {http.api_key}".encode() if http.api_key else None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = http.read_timeout_s  # socket timeout: idle keep-alive and stalled reads end
        server_version = routes.name

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._dispatch(post=False)

        def do_POST(self) -> None:  # noqa: N802
            self._dispatch(post=True)

        def _dispatch(self, post: bool) -> None:
            path = self.path.split("?", 1)[0]
            try:
                self._admit()
                if not post and (self.headers.get("Content-Length") or "0").strip() not in ("", "0"):
                    self.close_connection = True  # its body is not read: the connection cannot carry on
                body = self._body() if post else None
                if path in gets:
                    self._answer(gets[path])
                elif post and path in posts:
                    route = posts[path]
                    self._answer(lambda: route(body if body is not None else {}, self._gone))
                else:
                    self._send(404, {"error": f"no route {path[:100]}"})
            except _Refused as err:
                if err.close:
                    self.close_connection = True
                self._send(err.status, {"error": err.message}, err.headers)
            except _ClientGone:
                self.close_connection = True

        def _admit(self) -> None:
            if check_host and self.headers.get("Host") is not None:
                name = self.headers["Host"].rsplit(":", 1)[0] if not self.headers["Host"].endswith("]") \
                    else self.headers["Host"]
                if not (is_loopback(name) or name == host):
                    raise _Refused(403, "Host header names another site; this server answers only to "
                                        "localhost / loopback addresses")
            if self.headers.get("Origin") is not None:
                raise _Refused(403, "requests from web pages (with an Origin header) are refused")
            if expected_auth is not None:
                got = (self.headers.get("Authorization") or "").encode("latin-1", "replace")
                if not hmac.compare_digest(got, expected_auth):
                    raise _Refused(401, "missing or wrong API key: send `Authorization: Bearer KEY`",
                                   headers={"WWW-Authenticate": "Bearer"})

        def _body(self) -> Any:
            if self.headers.get("Transfer-Encoding") is not None:
                raise _Refused(411, "chunked request bodies are not accepted; send Content-Length", close=True)
            declared = self.headers.get("Content-Length")
            if declared is None or declared.strip() == "":
                return None
            if not declared.strip().isdigit():
                raise _Refused(400, f"Content-Length {declared[:40]!r} is not a number", close=True)
            length = int(declared)
            if length > routes.max_body_bytes:
                raise _Refused(413, f"body of {length} bytes is over this server's limit of "
                                    f"{routes.max_body_bytes}", close=True)
            if length == 0:
                return None
            kind = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                self._drain(length)
                raise _Refused(415, f"Content-Type must be application/json, got {kind[:60] or 'none'!r}")
            raw = self._read(length)
            try:
                return strict_json(raw)
            except ApiError as err:
                raise _Refused(err.status, err.message) from None

        def _read(self, length: int) -> bytes:
            """Exactly ``length`` body bytes, all within the read timeout (a stalled client gets 408)."""
            deadline = time.monotonic() + http.read_timeout_s
            chunks, got = [], 0
            while got < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Refused(408, f"body incomplete after {http.read_timeout_s:g}s ({got} of {length} "
                                        "bytes)", close=True)
                self.connection.settimeout(left)
                try:
                    chunk = self.rfile.read1(min(length - got, 1 << 20))
                except (TimeoutError, socket.timeout):
                    raise _Refused(408, f"body incomplete after {http.read_timeout_s:g}s ({got} of {length} "
                                        "bytes)", close=True) from None
                except OSError:
                    raise _ClientGone() from None
                if not chunk:
                    raise _ClientGone()
                chunks.append(chunk)
                got += len(chunk)
            self.connection.settimeout(http.read_timeout_s)
            return b"".join(chunks)

        def _drain(self, length: int) -> None:
            try:
                self._read(length)
            except (_Refused, _ClientGone):
                self.close_connection = True

        def _gone(self) -> bool:
            """True once the client closed its side (checked while its work runs)."""
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except (OSError, ValueError):
                return True

        def _answer(self, fn: Callable[[], tuple[int, Any]]) -> None:
            try:
                status, payload = fn()
            except ApiError as err:
                status, payload = err.status, {"error": err.message}
            except Cancelled as err:
                if self._gone():
                    raise _ClientGone() from None
                status, payload = 503, {"error": err.message}
            except RlctlError as err:
                status, payload = 400, {"error": str(err)}
            except Exception as err:  # noqa: BLE001 - a bug: keep serving, report it, keep the traceback
                traceback.print_exc(file=sys.stderr)
                status, payload = 500, {"error": f"internal error: {type(err).__name__}: {str(err)[:300]}"}
            self._send(status, payload)

        def _send(self, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
            if payload is None:
                data, kind = b"", "text/plain"
            elif isinstance(payload, str):
                data, kind = payload.encode(), "text/plain; charset=utf-8"
            else:
                data, kind = json.dumps(payload).encode(), "application/json"
            try:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            if verbose:
                super().log_message(format, *args)

    return Handler


class _HTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a bounded number of connection threads and a larger listen backlog."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], handler: type, http: HttpOptions) -> None:
        self.request_queue_size = http.backlog
        self._slots = threading.BoundedSemaphore(http.max_connections)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            body = b'{"error": "server busy: too many open connections; retry shortly"}'
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nRetry-After: 1\r\nContent-Length: "
                                + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return

        def work() -> None:
            try:
                self.process_request_thread(request, client_address)
            finally:
                self._slots.release()

        threading.Thread(target=work, name="rlctl-http", daemon=True).start()


class HttpServer:
    """A listening server: ``serve_forever()`` in one thread, ``shutdown()`` from another.

    ``cancel()`` is called first on shutdown (running work stops at its next
    step, new work is refused); ``close(timeout_s)`` once the socket stopped
    accepting (join the worker thread).
    """

    def __init__(self, routes: Routes, host: str, port: int, *, http: HttpOptions | None = None,
                 verbose: bool = False, cancel: Callable[[], None] = lambda: None,
                 close: Callable[[float], None] = lambda timeout_s: None, risk: str = "use the served model") -> None:
        self.http = http or HttpOptions()
        check_exposure(host, self.http.api_key, risk)
        self._cancel, self._close_worker = cancel, close
        try:
            self.httpd = _HTTPServer((host, port), make_handler(routes, self.http, host, verbose), self.http)
        except OSError as err:
            raise RoleError(f"cannot listen on {host}:{port}: {err.strerror}",
                            "pick a free port with --port (0 lets the OS choose) or stop what holds it") from err
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.httpd.server_address[1]}"
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        try:
            self.httpd.serve_forever(poll_interval=0.2)
        finally:
            self._close()

    def shutdown(self) -> None:
        """Stop accepting, cancel running work, release the port (returns within a few seconds)."""
        self._cancel()
        self.httpd.shutdown()
        self._stopped.wait(timeout=5)

    def _close(self) -> None:
        self._close_worker(3.0)
        self.httpd.server_close()
        self._stopped.set()


def serve_until_signal(server: HttpServer, ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT / SIGTERM; ``ready(url)`` is called once the socket listens."""
    def stop(signum: int, frame: Any) -> None:
        server._cancel()
        threading.Thread(target=server.httpd.shutdown, daemon=True).start()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if ready is not None:
            ready(server.url)
        server.serve_forever()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
