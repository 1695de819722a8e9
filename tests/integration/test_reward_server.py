"""`rlctl serve reward` under hostile and broken input, against a live server on 127.0.0.1.

The same rules as `serve rollout` (tests/integration/test_serve_fuzz.py), from
the same code (rlctl.serve.http_common): after each case the status is a 4xx
naming the problem (or scores within limits), another client is served
(a valid request succeeds and scores exactly as before), and the model thread
is idle again. Hypothesis then throws generated bodies at /score: never a
500, never a dropped connection. SIGTERM and the --host check run the real CLI.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlctl.serve.http_common import HttpOptions
from rlctl.serve.reward import RewardServer, build_reward_service
from tests.helpers import LiveServer, hostile_text, http_status
from tests.integration.test_cli import REPO

READ_TIMEOUT_S = 1.0
VALID = {"prompt": "3+4=", "response": "7"}


class Live(LiveServer):
    """One in-process reward server on an ephemeral port."""

    def __init__(self, model_dir: Path, http: HttpOptions | None = None, **service_kw) -> None:
        self.service = build_reward_service(model_dir, **{"max_wait_s": 0.002, **service_kw})
        super().__init__(RewardServer(self.service, "127.0.0.1", 0,
                                      http=http or HttpOptions(read_timeout_s=READ_TIMEOUT_S)))

    def post(self, body: object, path: str = "/score", **kw) -> tuple[int, object]:
        return self.request("POST", path, json.dumps(body).encode(), **kw)


@pytest.fixture(scope="module")
def live(tiny_reward_model_dir):
    server = Live(tiny_reward_model_dir)
    status, answer = server.post(VALID)
    assert status == 200, answer
    server.reference = answer["scores"][0]
    yield server
    server.stop()


def healthy_after(live: Live) -> None:
    """Another client is scored, exactly as before, and the model thread is idle again."""
    status, answer = live.post(VALID, timeout=5.0)
    assert status == 200 and answer["scores"] == pytest.approx([live.reference], abs=1e-5), answer
    deadline = time.monotonic() + 2.0
    while not live.service.worker.idle and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live.service.worker.idle, "the model thread is still working"


# -- what it serves ------------------------------------------------------------------------------------


def test_info_reports_the_model_hash_and_limits(live, tiny_reward_model_dir):
    status, info = live.request("GET", "/info")
    assert status == 200 and info["model_hash"] == live.service.model_hash and info["num_labels"] == 1
    assert info["limits"]["max_tokens"] == 256 and info["pair_encoding"] == "concatenate"
    assert live.request("GET", "/get_model_info")[1] == info and live.request("GET", "/model_info")[1] == info
    assert live.request("GET", "/health")[0] == 200
    status, answer = live.request("GET", "/health_score")
    assert status == 200 and answer["ok"]


def test_a_score_is_the_same_alone_batched_and_padded(live, tiny_reward_model_dir):
    """Right padding and pooling at the last real token: a batch scores each text as if alone."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = ["3+4=7", "12+30=42 because 12+30 is 42", "1"]
    status, answer = live.post({"text": texts})
    assert status == 200
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(tiny_reward_model_dir, local_files_only=True)
    with torch.inference_mode():
        alone = [float(model(**tok(t, return_tensors="pt")).logits[0, 0]) for t in texts]
    assert answer["scores"] == pytest.approx(alone, abs=1e-5)
    status, pair = live.post({"prompt": ["3+4="], "response": ["7"]})
    assert pair["scores"] == pytest.approx([alone[0]], abs=1e-5)  # a pair is prompt + response as one text


def test_concurrent_requests_share_forward_passes_and_each_gets_its_own_scores(tiny_reward_model_dir):
    server = Live(tiny_reward_model_dir, max_wait_s=0.2)  # a wide window, so the 6 requests meet
    try:
        singles = {k: server.post({"text": f"{k}+{k}={2 * k}"})[1]["scores"][0] for k in range(6)}
        before = server.service.worker.stats.batches
        results: dict[int, object] = {}
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(
            k, server.post({"text": f"{k}+{k}={2 * k}"}))) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(results[k][0] == 200 for k in range(6))
        assert {k: results[k][1]["scores"][0] for k in range(6)} == pytest.approx(singles, abs=1e-5)
        stats = server.service.worker.stats
        assert stats.batches - before < 6 and stats.largest_batch_requests > 1, stats
    finally:
        server.stop()


# -- bad requests fail alone ------------------------------------------------------------------------------


@pytest.mark.parametrize("body, field", [
    ({"text": ""}, "text is empty"),
    ({"text": []}, "text must be"),
    ({"text": [1, 2]}, "text must be"),
    ({"text": "x" * 20_000}, "characters"),
    ({"text": "x" * 300}, "positions"),
    ({"text": ["ok"] * 300}, "at most 256"),
    ({"prompt": "3+4="}, "prompt and response"),
    ({"prompt": ["a", "b"], "response": ["c"]}, "same length"),
    ({"prompt": "a", "response": ["c"]}, "same length"),
    ({"prompt": "", "response": ""}, "empty"),
    ({"text": "a", "prompt": "b", "response": "c"}, "either text"),
    ({"text": "a", "temperature": 1}, "unknown field `temperature`"),
    ({}, "either text"),
    ([1, 2], "JSON object"),
    ('{"text": "a", "n": 1e400}', "unknown field"),
])
def test_out_of_limit_or_mistyped_requests_are_400s_naming_the_field(live, body, field):
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    status, answer = live.request("POST", "/score", raw)
    assert status == 400 and field in answer["error"], answer
    healthy_after(live)


def test_a_bad_request_fails_alone_next_to_valid_ones(live):
    for _ in range(3):
        results: dict[str, tuple[int, object]] = {}
        bodies = {"bad": {"text": ["fine", "x" * 300]}, **{f"ok{k}": VALID for k in range(3)}}
        threads = [threading.Thread(target=lambda n=n, b=b: results.__setitem__(n, live.post(b)))
                   for n, b in bodies.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results["bad"][0] == 400 and "text[1]" in results["bad"][1]["error"]
        assert all(results[f"ok{k}"][0] == 200 and results[f"ok{k}"][1]["scores"] == pytest.approx([live.reference],
                                                                                              abs=1e-5)
                   for k in range(3)), results
    healthy_after(live)


def test_a_forward_pass_that_fails_is_retried_per_request_so_only_its_request_fails():
    """The model thread's isolation, with a forward function that fails on one poisoned row."""
    from rlctl.serve.reward import ScoreWorker

    gate, entered = threading.Event(), threading.Event()

    def forward(rows):  # a stand-in model: the first call waits so the next requests queue up together
        entered.set()
        gate.wait(10)
        if any(99 in r for r in rows):
            raise RuntimeError("poisoned row")
        return [float(sum(r)) for r in rows]

    worker = ScoreWorker(forward, max_wait_s=0.0, max_batch_rows=64)
    results: dict[str, object] = {}

    def call(name, rows):
        try:
            results[name] = worker.score(rows)
        except Exception as err:  # noqa: BLE001 - recorded for the assertion
            results[name] = err

    first = threading.Thread(target=call, args=("first", [[1]]))
    first.start()
    assert entered.wait(10)  # the first call holds the model thread at the gate
    deadline = time.monotonic() + 10
    rest = [threading.Thread(target=call, args=(n, r)) for n, r in (("a", [[1, 2]]), ("bad", [[99]]), ("b", [[3]]))]
    for t in rest:
        t.start()
    while worker._queue.qsize() < 3 and time.monotonic() < deadline:  # all three wait: they share the next pass
        time.sleep(0.005)
    gate.set()
    for t in [first, *rest]:
        t.join(10)
    worker.close()
    assert results["first"] == [1.0] and results["a"] == [3.0] and results["b"] == [3.0], results
    assert isinstance(results["bad"], RuntimeError)
    assert worker.stats.retried_alone == 3, worker.stats  # the shared pass failed; each of its 3 ran alone


def test_nan_literal_and_broken_bodies_get_a_400_response(live):
    cases = [b'{"text": NaN}', b"[" * 10_000, b'{"text": "\xff\xfe"}', b'{"text": "a"']
    for body in cases:
        status, answer = live.request("POST", "/score", body)
        assert status == 400 and answer["error"], (body[:40], answer)
    head = (f"POST /score HTTP/1.1\r\nHost: 127.0.0.1:{live.port}\r\nContent-Type: application/json\r\n"
            "Content-Length: abc\r\n\r\n{}")
    assert http_status(live.raw(head.encode())) == 400
    healthy_after(live)


def test_short_chunked_and_oversized_bodies_are_refused(live):
    body = json.dumps(VALID).encode()[:10]
    head = (f"POST /score HTTP/1.1\r\nHost: 127.0.0.1:{live.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: 1000\r\n\r\n").encode()
    assert http_status(live.raw(head + body)) == 408
    chunked = (f"POST /score HTTP/1.1\r\nHost: 127.0.0.1:{live.port}\r\nContent-Type: application/json\r\n"
               "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n").encode()
    assert http_status(live.raw(chunked)) == 411
    huge = (f"POST /score HTTP/1.1\r\nHost: 127.0.0.1:{live.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {64 << 20}\r\n\r\n").encode()
    assert http_status(live.raw(huge)) == 413
    healthy_after(live)


@pytest.mark.parametrize("headers, status", [
    ({"Host": "evil.example:80"}, 403), ({"Origin": "http://evil.example"}, 403),
    ({"Content-Type": "text/plain"}, 415),
])
def test_foreign_pages_and_non_json_bodies_are_refused(live, headers, status):
    code, answer = live.post(VALID, headers=headers)
    assert code == status and answer["error"], answer
    healthy_after(live)


def test_with_an_api_key_every_route_needs_it(tiny_reward_model_dir):
    keyed = Live(tiny_reward_model_dir, http=HttpOptions(api_key="s3cret", read_timeout_s=READ_TIMEOUT_S))
    try:
        routes = [("GET", p) for p in ("/health", "/health_score", "/info", "/model_info", "/get_model_info",
                                       "/server_info", "/get_server_info", "/metrics", "/nope")] + [("POST", "/score")]
        for method, path in routes:
            for auth in (None, "Bearer wrong", "s3cret", "Basic czNjcmV0"):
                body = json.dumps(VALID).encode() if method == "POST" else None
                status, answer = keyed.request(method, path, body, headers={"Authorization": auth})
                assert status == 401 and "API key" in answer["error"], (method, path, auth)
        assert keyed.post(VALID)[0] == 200
    finally:
        keyed.stop()


def test_a_causal_lm_or_a_multi_label_model_is_refused_with_a_hint(tiny_policy_dir, tmp_path):
    from rlctl.contracts.errors import ModelError
    from rlctl.models.reward_model import build_tiny_reward_model

    with pytest.raises(ModelError, match="not a sequence-classification reward model") as err:
        build_reward_service(tiny_policy_dir)
    assert "scripts/make_reward_model.py" in err.value.hint
    multi = build_tiny_reward_model(tmp_path / "multi")
    cfg = json.loads((multi / "config.json").read_text())
    cfg["id2label"] = {"0": "a", "1": "b"}
    (multi / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="2-label head"):
        build_reward_service(multi)
    with pytest.raises(ModelError, match="not found"):
        build_reward_service(tmp_path / "missing")


def test_a_non_loopback_bind_without_a_key_exits_1_with_one_line(tiny_reward_model_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RLCTL_SERVE_API_KEY", None)
    proc = subprocess.run([sys.executable, "-m", "rlctl.cli.app", "serve", "reward", "--model",
                           str(tiny_reward_model_dir), "--host", "0.0.0.0", "--port", "0"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--api-key" in lines[0] and "reward model" in lines[0], proc.stderr


# -- shutdown ---------------------------------------------------------------------------------------------


def test_shutdown_with_requests_in_flight_stops_the_model_thread(tiny_reward_model_dir):
    server = Live(tiny_reward_model_dir)
    body = json.dumps({"text": ["9+9=18 " * 30] * 256}).encode()
    socks = []
    for _ in range(4):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(f"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        socks.append(sock)
    server.stop()
    assert not server._thread.is_alive() and not server.service.worker.alive
    for sock in socks:
        try:
            answer = sock.recv(65536)
        except ConnectionResetError:  # closed before its body was read
            answer = b""
        assert answer == b"" or http_status(answer) in (200, 503)
        sock.close()


@pytest.mark.slow
def test_sigterm_stops_the_cli_server_cleanly(tiny_reward_model_dir, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "rlctl.cli.app", "serve", "reward", "--model",
                             str(tiny_reward_model_dir), "--port", "0"], stdout=subprocess.PIPE, stderr=log, text=True,
                            env=env, cwd=REPO)
    try:
        line = proc.stdout.readline()
        assert "listening on" in line and "model_hash" in line, line
        port = int(line.split("listening on ", 1)[1].split()[0].rsplit(":", 1)[1])
        body = json.dumps({"text": ["9+9=18 " * 30] * 256}).encode()
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(f"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        try:
            answer = sock.recv(65536)
        except ConnectionResetError:
            answer = b""
        assert answer == b"" or http_status(answer) in (200, 503)
        sock.close()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()  # the port is released
        log.seek(0)
        assert "Traceback" not in log.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        log.close()


# -- generated bodies ---------------------------------------------------------------------------------

# Text includes lone surrogates and control characters (sent as JSON escapes): never a 500.
_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                     | hostile_text(20), lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(hostile_text(12), inner, max_size=4), max_leaves=12)
_texts = hostile_text(40) | st.lists(hostile_text(40), max_size=4)
_bodies = st.fixed_dictionaries({}, optional={"text": _texts | _json, "prompt": _texts | _json,
                                              "response": _texts | _json}) | _json


def _fuzz(live: Live, body: object) -> None:
    status, answer = live.post(body, timeout=30)
    assert status in (200, 400), (status, answer)
    if status == 400:
        assert isinstance(answer, dict) and answer["error"]
    else:
        assert all(s is None or isinstance(s, float) for s in answer["scores"])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=_bodies)
def test_generated_bodies_never_break_the_server(live, body):
    _fuzz(live, body)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_bodies)
def test_many_generated_bodies_never_break_the_server(live, body):
    _fuzz(live, body)


def test_the_server_is_healthy_after_the_generated_bodies(live):
    healthy_after(live)
    assert live.request("GET", "/server_info")[1]["rlctl"]["requests"] > 0


def test_a_tokenizer_with_a_chat_template_encodes_pairs_with_it_and_changes_the_hash(tiny_reward_model_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    chat = tmp_path / "chat-rm"
    shutil.copytree(tiny_reward_model_dir, chat)
    tok = AutoTokenizer.from_pretrained(chat, local_files_only=True)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    tok.save_pretrained(chat)
    plain, templated = build_reward_service(tiny_reward_model_dir), build_reward_service(chat)
    try:
        assert templated.info()["pair_encoding"] == "chat_template" and plain.info()["pair_encoding"] == "concatenate"
        assert templated.model_hash != plain.model_hash  # same weights, another encoding: another grader
        rendered = templated.tokenizer("[user] 3+4= [assistant] 7 ", add_special_tokens=False)["input_ids"]
        assert templated.encode("3+4=", "7") == rendered  # the template's text, no tokens added around it
        _, pair = templated.score({"prompt": "3+4=", "response": "7"})
        assert pair["scores"] == pytest.approx(templated.worker.score([rendered]), abs=1e-5)
    finally:
        plain.close()
        templated.close()
