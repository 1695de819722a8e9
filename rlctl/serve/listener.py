"""Listening for both ``rlctl serve`` servers: uvicorn (HTTP/1.1 by h11) with request deadlines, and shutdown.

What this is: ``HttpServer`` binds the socket itself (a bind failure is one
clear error, port 0 picks a free port and the URL is known before serving),
then runs the app of rlctl.serve.asgi on ``uvicorn.Server``. HTTP parsing,
keep-alive, pipelining and request framing are h11's: a body is always read
as that request's body (a refused request's body is drained, never parsed
as another request). uvicorn caps open connections (``max_connections``:
503 past it). What uvicorn lacks, ``_Protocol`` (an h11 protocol subclass,
uvicorn's documented ``http=`` hook) adds:

- a head deadline: a request's line and headers must arrive whole within
  ``read_timeout_s`` of the moment the connection is ready for one, however
  slowly they trickle in (slow-header clients get 408 and are closed;
  idle keep-alive connections are closed), so idle or slow sockets hold
  only a file descriptor, never a request slot, and never for long;
- a drain deadline: the unread body of an answered request (a 401, a 413)
  is read and discarded for at most ``read_timeout_s``, so the client sees
  its answer and the connection stays usable, but a trickle cannot hold it;
- malformed HTTP (request line, headers, ``Content-Length: ²``) answered
  400 in the server's error shape instead of uvicorn's plain text.

Shutdown: ``shutdown()`` (or SIGTERM / SIGINT in ``serve_until_signal``)
calls the server's ``cancel`` first, so running work stops at its next step
and in-flight clients get their 503, then uvicorn stops accepting, closes
idle connections and waits up to 3 s for answers in flight.

What this is not: the app (rlctl.serve.asgi) or a production deployment
(put TLS and public exposure behind a real proxy).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
from typing import Any, Callable, Iterator

import h11
from uvicorn import Config, Server
from uvicorn.protocols.http.h11_impl import H11Protocol

from rlctl.contracts.errors import RoleError
from rlctl.serve.asgi import build_app
from rlctl.serve.http_common import HttpOptions, Routes, check_exposure

_HEAD_BYTES = 64 << 10  # request line + headers


def _raw_answer(status: int, reason: str, payload: Any) -> bytes:
    body = json.dumps(payload).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with head / drain deadlines and JSON 400s (``protocol_class`` sets the two below)."""

    deadline_s: float = 10.0
    routes: Routes
    _timer: asyncio.TimerHandle | None = None
    _phase: str | None = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def send_400_response(self, msg: str) -> None:
        self._arm(None)
        if not self.transport.is_closing():
            self.transport.write(_raw_answer(400, "Bad Request", self.routes.error_body(
                "", "malformed HTTP request (request line, headers or Content-Length); nothing was run")))
            self.transport.close()

    def _track(self) -> None:
        """Arm the deadline of the phase the connection is in; a phase keeps its first deadline."""
        theirs, ours = self.conn.their_state, self.conn.our_state
        if self.transport is None or self.transport.is_closing():
            phase = None
        elif theirs is h11.IDLE and ours is h11.IDLE:
            phase = "head"  # waiting for (the rest of) a request line and headers
        elif theirs is h11.SEND_BODY and ours in (h11.DONE, h11.MUST_CLOSE):
            phase = "drain"  # answered; discarding the body it did not read
        else:
            phase = None  # the app reads the body under its own deadline, or works, or answers
        if phase != self._phase:
            self._arm(phase)

    def _arm(self, phase: str | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._phase, self._timer = phase, None
        if phase is not None:
            self._timer = self.loop.call_later(self.deadline_s, self._expired)

    def _expired(self) -> None:
        started = bool(self.conn.trailing_data[0])  # part of a request head has arrived
        self._arm(None)
        if self.transport.is_closing():
            return
        if started and self.conn.their_state is h11.IDLE:
            self.transport.write(_raw_answer(408, "Request Timeout", self.routes.error_body(
                "", f"request line and headers incomplete after {self.deadline_s:g}s")))
        self.transport.close()


def protocol_class(routes: Routes, http: HttpOptions) -> type[H11Protocol]:
    """The protocol class of one server: its deadline and error shape (uvicorn builds one per connection)."""
    return type("ServerProtocol", (_Protocol,), {"deadline_s": http.read_timeout_s, "routes": routes})


class _Uvicorn(Server):
    """uvicorn's server with signals left to ``serve_until_signal`` (uvicorn would re-raise them on exit)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets, and without it a response's
    # headers and body (two writes) wait out the client's delayed ACK, ~40 ms per request
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(backlog)
    except OSError as err:
        sock.close()
        raise RoleError(f"cannot listen on {host}:{port}: {err.strerror}",
                        "pick a free port with --port (0 lets the OS choose) or stop what holds it") from err
    return sock


class HttpServer:
    """A listening server: ``serve_forever()`` in one thread, ``shutdown()`` from another.

    ``cancel()`` is called first on shutdown (running work stops at its next
    step, new work is refused); ``close(timeout_s)`` once the server stopped
    (join the model thread).
    """

    def __init__(self, routes: Routes, host: str, port: int, *, http: HttpOptions | None = None,
                 verbose: bool = False, cancel: Callable[[], None] = lambda: None,
                 close: Callable[[float], None] = lambda timeout_s: None, risk: str = "use the served model") -> None:
        self.http = http = http or HttpOptions()
        check_exposure(host, http.api_key, risk)
        self._cancel, self._close_worker = cancel, close
        self._sock = _listen(host, port, http.backlog)
        shown = f"[{host.strip('[]')}]" if ":" in host else host
        self.url = f"http://{shown}:{self._sock.getsockname()[1]}"
        logging.getLogger("uvicorn.error").setLevel(logging.ERROR)  # hostile clients must not flood the log
        logging.getLogger("uvicorn.access").setLevel(logging.INFO if verbose else logging.WARNING)
        config = Config(build_app(routes, http, host), http=protocol_class(routes, http), loop="asyncio",
                        lifespan="off", log_config=None, access_log=verbose, proxy_headers=False,
                        server_header=False, headers=[("server", routes.name)], limit_concurrency=http.max_connections,
                        timeout_keep_alive=int(max(1, http.read_timeout_s)), timeout_graceful_shutdown=3,
                        h11_max_incomplete_event_size=_HEAD_BYTES, backlog=http.backlog)
        self._server = _Uvicorn(config)
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        finally:
            self._close()

    def stop_serving(self) -> None:
        """Cancel running work and ask the server to stop (returns at once; safe from a signal handler)."""
        self._cancel()
        self._server.should_exit = True

    def shutdown(self) -> None:
        """Stop accepting, cancel running work, release the port (returns within a few seconds)."""
        self.stop_serving()
        self._stopped.wait(timeout=8)

    def _close(self) -> None:
        try:
            self._close_worker(3.0)
        finally:
            self._sock.close()
            self._stopped.set()


def serve_until_signal(server: HttpServer, ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT / SIGTERM; ``ready(url)`` is called once the socket listens."""
    previous = {sig: signal.signal(sig, lambda signum, frame: server.stop_serving())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if ready is not None:
            ready(server.url)
        server.serve_forever()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
