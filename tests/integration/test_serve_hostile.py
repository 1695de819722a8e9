"""Issue 25's hostile clients against both ``rlctl serve`` servers, live on 127.0.0.1.

Every conversation here reads *every* response the server sends on the
connection (tests.helpers.read_responses), so a request smuggled inside a
refused request's body would show up as a second answer, and a connection
that a refusal left unusable would show up as a missing one. After each case:
the served weights / version / fingerprint (rollout) or the request counters
(reward) are as expected, and a valid request from another client is served
within 2 s. Also: slow-header connections holding every slot, lone surrogates,
odd Content-Lengths, symlinked and non-finite weight files, oversized bodies
that the client must still see refused, /metrics in the Prometheus format, and
generated raw request heads (never a 5xx, never a broken answer).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlctl.contracts.errors import RoleError
from rlctl.serve.http_common import HttpOptions
from tests.helpers import hold_slow_headers, raw_request, read_responses, wait_until
from tests.integration.test_cli import REPO
from tests.integration.test_reward_server import Live as LiveReward
from tests.integration.test_serve_fuzz import VALID, error
from tests.integration.test_serve_fuzz import Live as LiveRollout

KEY = "k3y-for-tests"
READ_TIMEOUT_S = 3.0  # head / body / idle deadline of the servers here: longer than a conversation's pauses
SCORE = {"prompt": "3+4=", "response": "7"}


class Target:
    """One live server plus what a valid request, a state snapshot and a smuggled request are for it."""

    def __init__(self, kind: str, live, root: Path | None = None) -> None:
        self.kind, self.live, self.root = kind, live, root
        self.path, self.valid = ("/generate", VALID) if kind == "rollout" else ("/score", SCORE)

    def state(self) -> tuple:
        if self.kind == "rollout":
            info = self.live.request("GET", "/get_model_info")[1]
            return info["weight_version"], info["rlctl"]["fingerprint"]
        return self.live.service.model_hash, self.live.service.worker.stats.requests

    def inner(self) -> bytes:
        """A complete, valid request that would change the state if it ever ran."""
        if self.kind == "rollout":
            body = json.dumps({"model_path": str(self.root / "same"), "weight_version": "smuggled"}).encode()
            return raw_request("POST", "/update_weights_from_disk", body, port=self.live.port)
        return raw_request("POST", "/score", json.dumps(SCORE).encode(), port=self.live.port)

    def message(self, answer: bytes | object) -> str:
        parsed = json.loads(answer) if isinstance(answer, bytes) else answer
        if self.kind == "rollout":
            return error(parsed)
        assert isinstance(parsed, dict) and set(parsed) == {"error"} and parsed["error"], parsed
        return parsed["error"]

    def healthy(self) -> None:
        started = time.monotonic()
        status, answer = self.live.request("POST", self.path, json.dumps(self.valid).encode(), timeout=2.0)
        assert status == 200, answer
        assert time.monotonic() - started < 2.0


def _rollout(tiny_policy_dir: Path, root: Path, http: HttpOptions) -> Target:
    if not (root / "same").exists():
        shutil.copytree(tiny_policy_dir, root / "same")
    return Target("rollout", LiveRollout(tiny_policy_dir, http=http, weights_root=root), root)


@pytest.fixture(scope="module")
def rollout(tiny_policy_dir, tmp_path_factory):
    target = _rollout(tiny_policy_dir, tmp_path_factory.mktemp("root"), HttpOptions(read_timeout_s=READ_TIMEOUT_S))
    yield target
    target.live.stop()


@pytest.fixture(scope="module")
def reward(tiny_reward_model_dir):
    target = Target("reward", LiveReward(tiny_reward_model_dir, http=HttpOptions(read_timeout_s=READ_TIMEOUT_S)))
    yield target
    target.live.stop()


@pytest.fixture(scope="module")
def keyed(tiny_policy_dir, tiny_reward_model_dir, tmp_path_factory):
    http = HttpOptions(api_key=KEY, read_timeout_s=READ_TIMEOUT_S)
    targets = {"rollout": _rollout(tiny_policy_dir, tmp_path_factory.mktemp("keyed-root"), http),
               "reward": Target("reward", LiveReward(tiny_reward_model_dir, http=http))}
    yield targets
    for target in targets.values():
        target.live.stop()


@pytest.fixture(params=["rollout", "reward"])
def target(request) -> Target:
    return request.getfixturevalue(request.param)


def converse(port: int, data: bytes, quiet_s: float = 1.0) -> tuple[socket.socket, list]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(data)
    return sock, read_responses(sock, quiet_s=quiet_s)


# -- smuggling ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("refusal", [{"Origin": "http://evil.example"}, {"Host": "evil.example"},
                                     {"Host": "localhost:80, evil.example"}])
def test_a_request_smuggled_in_a_refused_body_never_runs(target: Target, refusal: dict) -> None:
    """A web page's no-CORS POST (text/plain, Origin) or a DNS-rebinding page (foreign Host) whose body is a
    complete request: one refusal comes back, the inner request never runs, and the connection still serves."""
    before = target.state()
    inner = target.inner()
    outer = raw_request("POST", target.path, inner, port=target.live.port,
                        headers={"Content-Type": "text/plain", **refusal})
    sock, answers = converse(target.live.port, outer)
    with sock:
        assert [status for status, _, _ in answers] == [400 if "," in refusal.get("Host", "") else 403], answers
        target.message(answers[0][2])
        assert target.state() == before  # nothing ran: weights, version, fingerprint / request counter
        sock.sendall(raw_request("POST", target.path, json.dumps(target.valid).encode(), port=target.live.port))
        again = read_responses(sock)
    assert [status for status, _, _ in again] == [200], again  # keep-alive: its real answer
    target.healthy()


@pytest.mark.parametrize("kind", ["rollout", "reward"])
def test_after_a_401_a_keep_alive_client_gets_its_real_answer(keyed, kind: str) -> None:
    target = keyed[kind]
    before = target.state()
    port = target.live.port
    refused = raw_request("POST", target.path, target.inner(), port=port, headers={"Authorization": "Bearer nope"})
    sock, answers = converse(port, refused)
    with sock:
        assert [status for status, _, _ in answers] == [401] and answers[0][1]["www-authenticate"] == "Bearer"
        assert "API key" in target.message(answers[0][2])
        assert target.state() == before
        body = json.dumps(target.valid).encode()
        sock.sendall(raw_request("POST", target.path, body, port=port, headers={"Authorization": f"Bearer {KEY}"}))
        assert [status for status, _, _ in read_responses(sock)] == [200]


# -- slot exhaustion ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["rollout", "reward"])
@pytest.mark.parametrize("with_key", [False, True], ids=["open", "keyed"])
def test_slow_header_and_idle_connections_do_not_starve_a_valid_client(request, keyed, kind, with_key) -> None:
    target = keyed[kind] if with_key else request.getfixturevalue(kind)
    stop = threading.Event()
    slow = hold_slow_headers(target.live.port, 64, stop)
    idle = [socket.create_connection(("127.0.0.1", target.live.port), timeout=5) for _ in range(64)]
    try:
        started = time.monotonic()
        headers = {"Authorization": f"Bearer {KEY}"} if with_key else None
        status, answer = target.live.request("POST", target.path, json.dumps(target.valid).encode(), headers=headers,
                                             timeout=2.0)
        assert status == 200 and time.monotonic() - started < 2.0, answer
        # the server does not wait for them: a head that trickles in is cut at the deadline, an idle socket closed
        closed = [read_responses(sock, quiet_s=READ_TIMEOUT_S + 3.0) for sock in slow[:4] + idle[:4]]
        assert all(not answers or [s for s, _, _ in answers] == [408] for answers in closed), closed
    finally:
        stop.set()
        for sock in slow + idle:
            sock.close()


# -- the low-severity list ---------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b'{"text": "\\ud800"}', b'{"text": ["ok", "a\\udfffb"]}',
                                  b'{"prompt": "\\udc80", "response": "7"}', b'{"\\ud800": 1}'])
def test_lone_surrogates_are_400s(target: Target, body: bytes) -> None:
    status, answer = target.live.request("POST", target.path, body)
    assert status == 400 and "surrogate" in target.message(answer), answer
    target.healthy()


@pytest.mark.parametrize("header", ["²", "-1", "1e3", "2, 3", "2, 2", " +2", "0x10", "99999999999999999999999"])
def test_odd_content_lengths_are_400s_in_the_error_shape(target: Target, header: str) -> None:
    head = (f"POST {target.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {header}\r\n\r\n{{}}").encode()
    sock, answers = converse(target.live.port, head)
    sock.close()
    statuses = [status for status, _, _ in answers]
    assert statuses and statuses[0] in (400, 413) and len(statuses) == 1, answers
    target.message(answers[0][2])
    target.healthy()


@pytest.mark.parametrize("version", ["²", "9" * 5000, "v" * 65, "has space", "", -1, 1.5, True])
def test_weight_versions_are_short_printable_ascii(rollout: Target, version) -> None:
    before = rollout.state()
    status, answer = rollout.live.post("/update_weights_from_disk", {"model_path": str(rollout.root / "same"),
                                                                     "weight_version": version})
    assert status == 400 and "weight_version" in error(answer), answer
    assert rollout.state() == before
    rollout.healthy()


def test_a_5000_digit_weight_version_number_is_a_400(rollout: Target) -> None:
    body = b'{"model_path": "%s", "weight_version": %s}' % (str(rollout.root / "same").encode(), b"9" * 5000)
    status, answer = rollout.live.request("POST", "/update_weights_from_disk", body)
    assert status == 400 and error(answer)
    rollout.healthy()


def test_a_weight_file_symlinked_out_of_the_root_is_refused(rollout: Target, tiny_policy_dir: Path) -> None:
    linked = rollout.root / "linked"
    shutil.copytree(tiny_policy_dir, linked, ignore=shutil.ignore_patterns("model.safetensors"))
    os.symlink(tiny_policy_dir / "model.safetensors", linked / "model.safetensors")  # outside the root
    before = rollout.state()
    status, answer = rollout.live.post("/update_weights_from_disk", {"model_path": str(linked)})
    assert status == 403 and "outside the server's weights root" in error(answer), answer
    assert rollout.state() == before
    rollout.healthy()


def test_non_finite_weights_are_refused_before_staging(rollout: Target, tiny_policy_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    bad = rollout.root / "nan"
    shutil.copytree(tiny_policy_dir, bad)
    state = load_file(bad / "model.safetensors")
    name = sorted(n for n, t in state.items() if t.is_floating_point())[0]
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("nan")
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    before = rollout.state()
    status, answer = rollout.live.post("/update_weights_from_disk", {"model_path": str(bad), "weight_version": "n"})
    assert status == 400 and "NaN" in error(answer) and name in error(answer), answer
    assert rollout.state() == before
    sampled = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}}
    assert rollout.live.post("/generate", sampled)[0] == 200
    assert rollout.live.request("GET", "/health_generate")[0] == 200
    assert torch.isfinite(rollout.live.service.worker.engine.state_dict()[name]).all()


def test_unknown_top_level_fields_are_refused(rollout: Target) -> None:
    typo = {"input_ids": [1, 5], "sampling_param": {"max_new_tokens": 2}}
    status, answer = rollout.live.post("/generate", typo)
    assert status == 400 and "unknown field `sampling_param`" in error(answer), answer
    status, answer = rollout.live.post("/generate", {**VALID, "lora_path": "x"})
    assert status == 400 and "lora_path" in error(answer)
    status, answer = rollout.live.post("/update_weights_from_disk", {"model_path": str(rollout.root / "same"),
                                                                     "model_pth": "x"})
    assert status == 400 and "model_pth" in error(answer)
    rollout.healthy()


def test_a_client_sees_the_413_and_keeps_its_connection(target: Target) -> None:
    """The client sends its whole over-limit body before reading (as urllib does): it must still get the 413."""
    limit = target.live.service.limits.max_body_bytes
    conn = http.client.HTTPConnection("127.0.0.1", target.live.port, timeout=30)
    try:
        conn.request("POST", target.path, body=b"[" + b" " * limit + b"]", headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 413 and "limit" in target.message(resp.read())
        conn.request("POST", target.path, body=json.dumps(target.valid).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        resp.read()
    finally:
        conn.close()


def test_many_long_texts_cost_one_tokenization_before_their_400(rollout: Target) -> None:
    service, calls = rollout.live.service, []
    tokenize = service._tokenize
    service._tokenize = lambda text: calls.append(len(text)) or tokenize(text)  # counts, then tokenizes
    try:
        room = service.limits.positions - 1
        status, answer = rollout.live.post("/generate", {"text": ["7+" * room] * 512,
                                                         "sampling_params": {"max_new_tokens": 1}})
    finally:
        del service._tokenize
    assert status == 400 and "text[0]" in error(answer) and "tokens" in error(answer), answer
    assert len(calls) == 1, f"tokenized {len(calls)} texts before refusing"
    rollout.healthy()


@pytest.mark.parametrize("key, problem", [("ключ", "printable ASCII"), ("a b", "printable ASCII"),
                                          ("   ", "blank"), ("k\x00", "printable ASCII")])
def test_api_keys_that_cannot_match_are_refused_at_start(key: str, problem: str) -> None:
    with pytest.raises(RoleError, match=problem):
        HttpOptions(api_key=key)


@pytest.mark.parametrize("kind", ["rollout", "reward"])
def test_a_blank_api_key_on_the_cli_is_one_line(kind: str, tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", RLCTL_SERVE_API_KEY="   ")
    proc = subprocess.run([sys.executable, "-m", "rlctl.cli.app", "serve", kind, "--model", str(tmp_path),
                           "--port", "0"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "blank" in errors[0], proc.stderr


# -- /metrics ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["rollout", "reward"])
def test_metrics_need_the_key_and_parse_as_prometheus_text(keyed, kind: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    target = keyed[kind]
    auth = {"Authorization": f"Bearer {KEY}"}
    assert target.live.request("POST", target.path, json.dumps(target.valid).encode(), headers=auth)[0] == 200
    assert target.live.request("POST", target.path, b"[", headers=auth)[0] == 400
    assert target.live.request("GET", "/metrics", headers={"Authorization": None})[0] == 401
    curl = subprocess.run(["curl", "-sS", "-H", f"Authorization: Bearer {KEY}", f"{target.live.server.url}/metrics"],
                          capture_output=True, text=True, timeout=30) if shutil.which("curl") else None
    text = curl.stdout if curl is not None else target.live.request("GET", "/metrics", headers=auth)[1]
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("rlctl_http_requests_total", (("method", "POST"), ("route", target.path), ("status", "200")))] >= 1
    assert samples[("rlctl_http_request_errors_total", (("route", target.path), ("status", "400")))] >= 1
    assert samples[("rlctl_http_requests_total", (("method", "GET"), ("route", "/metrics"), ("status", "401")))] >= 1
    assert families["rlctl_http_request_duration_seconds"].type == "histogram"
    assert families["rlctl_engine_batch_rows"].type == "histogram" and samples[("rlctl_engine_batch_rows_count", ())]
    for name in ("rlctl_engine_queue_depth", "rlctl_engine_seconds", "rlctl_engine_rows", "rlctl_engine_batches"):
        assert name in families, sorted(families)
    info = "rlctl_weight_version_info" if kind == "rollout" else "rlctl_reward_model_info"
    assert families[info].samples[0].value == 1 and families[info].samples[0].labels


# -- generated request heads -------------------------------------------------------------------------------

_token = st.text(st.sampled_from("GETPOSTHEADputx-_/?%:;,=\\ \t\x00\x7f\xa7\xff²"), min_size=0, max_size=12)
_heads = st.tuples(
    st.sampled_from(["GET", "POST", "HEAD", "PUT", "OPTIONS", "GE T", "", "POST\x00"]) | _token,
    st.sampled_from(["/generate", "/score", "/health", "/metrics", "*", "//", "/%00", "/\xff"]) | _token,
    st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "HTTP/1.1x", ""]),
    st.lists(st.tuples(st.sampled_from(["Content-Length", "Transfer-Encoding", "Host", "Content-Type", "Origin",
                                        "Authorization", "Connection", "Expect"]) | _token, _token), max_size=5),
    st.binary(max_size=24))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(head=_heads)
def test_generated_request_heads_never_get_a_5xx(rollout: Target, reward: Target, head) -> None:
    method, path, version, headers, body = head
    data = (f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
            + "\r\n").encode("latin-1", "replace") + body
    for target in (rollout, reward):
        sock, answers = converse(target.live.port, data, quiet_s=0.3)
        sock.close()
        assert all(status < 500 for status, _, _ in answers), (data, answers)


def test_the_servers_are_healthy_after_the_generated_heads(rollout: Target, reward: Target) -> None:
    for target in (rollout, reward):
        target.healthy()
        assert wait_until(lambda: target.live.service.worker.idle)


def test_answers_are_not_held_back_by_nagle(rollout: Target) -> None:
    """Accepted sockets get TCP_NODELAY (asyncio sets it only when the listener's proto is IPPROTO_TCP); without it
    an answer's body waited for the client's delayed ACK, ~40 ms a request (bench/serve_http.py)."""
    listener = rollout.live.server._sock
    assert listener.proto == socket.IPPROTO_TCP
    with socket.create_connection(("127.0.0.1", rollout.live.port), timeout=5) as sock:
        sock.sendall(raw_request("GET", "/health", port=rollout.live.port))
        assert [status for status, _, _ in read_responses(sock, quiet_s=0.5)] == [200]
