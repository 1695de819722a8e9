"""Shared test helpers: one rollout batch from a session, its logprob mismatch, an in-process HTTP server,
raw HTTP conversations that read every response on a connection, and hostile text for hypothesis."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

from rlctl.contracts.types import LearnerContext, RolloutRequest


def build_roles(config, plugins, cache_root, **kw):
    """The roles of ``config`` placed in this process (``rlctl.placement.place``); the caller closes the rollout."""
    from rlctl.placement import place

    return place(config, plugins, cache_root=cache_root, **kw).roles


def placed(config, plugins, cache_root, **kw):
    """The placement of ``config`` (its ``roles`` and ``close``)."""
    from rlctl.placement import place

    return place(config, plugins, cache_root=cache_root, **kw)


def rollout_batch(session, advantages=None, num_prompts: int = 4, group_size: int = 4):
    """Generate ``group_size`` samples for the first train prompts; return (trajectories, TrainBatch)."""
    from rlctl.engine.batching import build_batch

    requests = [RolloutRequest(prompt_id=p.id, prompt_tokens=tuple(session.tokenizer(p.text)["input_ids"]),
                               group_size=group_size, sampling=session.sampling,
                               dataset_version=session.task.version)
                for p in session.task.train[:num_prompts]]
    trajectories = session.rollout.generate(requests)
    adv = advantages if advantages is not None else [0.0] * len(trajectories)
    return trajectories, build_batch(trajectories, adv, session.tokenizer.pad_token_id, session.sampling)


def logprob_mismatch(session, batch) -> float:
    """max |log pi_learner - log mu_behaviour| over trained tokens."""
    mask = batch.action_mask > 0
    assert int(mask.sum()) > 0
    return float((session.learner.logprobs(batch) - batch.behavior_logprobs)[mask].abs().max())


def learner_context(session, micro_batch_size: int) -> LearnerContext:
    """A deterministic CPU learner context for the session's policy: lr 1e-3, tight clipping (the sharded-learner
    equivalence tests compare learners built from it)."""
    cfg = session.config
    return LearnerContext(model_dir=str(session.policy_dir),
                          algo=cfg.algo.model_copy(update={"micro_batch_size": micro_batch_size}),
                          optim=cfg.train.optim.model_copy(update={"lr": 1e-3, "grad_clip": 0.05}), seed=0,
                          max_response_tokens=cfg.rollout.max_tokens, deterministic=True, device="cpu")


class LiveServer:
    """An rlctl HTTP server (rollout or reward) serving on an ephemeral port from a thread of this process."""

    def __init__(self, server) -> None:
        self.server = server
        self.port = int(server.url.rsplit(":", 1)[1])
        self.key = server.http.api_key
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = 30.0) -> tuple[int, object]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {}),
                    **(headers or {})}
            conn.request(method, path, body=body, headers={k: v for k, v in sent.items() if v is not None})
            resp = conn.getresponse()
            raw = resp.read()
            kind = resp.getheader("Content-Type") or ""
            return resp.status, json.loads(raw) if "json" in kind and raw else raw.decode(errors="replace")
        finally:
            conn.close()

    def raw(self, data: bytes, timeout: float = 10.0) -> bytes:
        """Send raw bytes on a fresh connection; what came back before the server closed it (or timeout)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            sock.sendall(data)
            out = b""
            try:
                while chunk := sock.recv(65536):
                    out += chunk
                    if b"\r\n\r\n" in out and _complete(out):
                        break
            except socket.timeout:
                pass
            return out

    def stop(self) -> None:
        self.server.shutdown()
        self._thread.join(timeout=10)


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return True


def http_status(response: bytes) -> int:
    """The status code of a raw HTTP response."""
    assert response.startswith(b"HTTP/1."), f"no HTTP response: {response[:200]!r}"
    return int(response.split(b" ", 2)[1])


def read_responses(sock: socket.socket, quiet_s: float = 1.0, limit: int = 8) -> list[tuple[int, dict, bytes]]:
    """Every complete response the server sends on ``sock`` until it closes the connection or is quiet for
    ``quiet_s`` (or ``limit`` responses): (status, lower-cased headers, body) each. Reading them all is how
    a request smuggled in a body would show up: as a second response."""
    out, buf = [], b""
    sock.settimeout(quiet_s)
    while len(out) < limit:
        while b"\r\n\r\n" in buf:
            head, _, rest = buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            length = int(headers.get("content-length", "0"))
            if len(rest) < length:
                break
            out.append((int(lines[0].split(" ", 2)[1]), headers, rest[:length]))
            buf = rest[length:]
            if len(out) >= limit:
                return out
        try:
            chunk = sock.recv(65536)
        except (socket.timeout, ConnectionResetError):
            return out
        if not chunk:
            return out
        buf += chunk
    return out


def raw_request(method: str, path: str, body: bytes = b"", *, port: int, headers: dict | None = None) -> bytes:
    """One HTTP/1.1 request as bytes (Host 127.0.0.1:port, JSON content type unless overridden)."""
    sent = {"Host": f"127.0.0.1:{port}", "Content-Type": "application/json", "Content-Length": str(len(body)),
            **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in sent.items() if v is not None)
    return (head + "\r\n").encode("latin-1") + body


def hold_slow_headers(port: int, count: int, stop: threading.Event) -> list[socket.socket]:
    """``count`` connections that send a request head one byte at a time, ~1 byte/s, until ``stop``."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]
    head = f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Slow: ".encode() + b"a" * 64

    def trickle() -> None:
        for i in range(len(head)):
            if stop.wait(1.0):
                return
            for sock in socks:
                try:
                    sock.sendall(head[i:i + 1])
                except OSError:
                    pass

    threading.Thread(target=trickle, daemon=True).start()
    for sock in socks:
        sock.sendall(head[:1])
    return socks


def wait_until(predicate, timeout_s: float = 5.0, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(step_s)
    return True


def hostile_text(max_size: int):
    """Hypothesis text that includes lone surrogates, control characters and format characters."""
    from hypothesis import strategies as st

    special = st.sampled_from(["\ud800", "\udfff", "\udc80", "\x00", "\x1b", "\x7f", "\u202e", "\ufeff", "\r", "\n"])
    return st.lists(st.characters(exclude_categories=()) | special, max_size=max_size).map("".join)
