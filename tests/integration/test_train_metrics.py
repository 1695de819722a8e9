"""``train.metrics_port``: the trainer's step metrics at /metrics in the Prometheus text format.

The endpoint (rlctl.serve.train_metrics) is served for real on 127.0.0.1 and read back with
prometheus_client's parser; one real `rlctl train` (slow) is scraped while it runs.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlctl.serve.train_metrics import MetricsEndpoint, metric_name
from tests.conftest import TINY_OVERRIDES
from tests.helpers import raw_request, read_responses
from tests.integration.test_cli import REPO


def scrape(url: str) -> dict[str, tuple[dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_latest_step_is_served_with_sanitized_names(tmp_path: Path) -> None:
    endpoint = MetricsEndpoint(0, run_id="run-1", run_dir=tmp_path)
    try:
        assert (tmp_path / "metrics.url").read_text().strip() == endpoint.url
        assert "rlctl_train_step" not in scrape(endpoint.url)  # nothing logged yet
        endpoint.write(1, {"reward/mean": 0.25, "loss": 1.5})
        endpoint.write(2, {"reward/mean": 0.5, "loss": float("nan"), "timing/rollout_s": 0.1})
        samples = scrape(endpoint.url)
        assert samples["rlctl_train_step"] == ({"run_id": "run-1"}, 2.0)
        assert samples[metric_name("reward/mean")] == ({"run_id": "run-1"}, 0.5)
        assert metric_name("reward/mean") == "rlctl_train_reward_mean"
        assert math.isnan(samples["rlctl_train_loss"][1]) and "rlctl_train_timing_rollout_s" in samples
        assert samples['rlctl_http_requests_total'][1] >= 1  # the endpoint's own request counter
    finally:
        endpoint.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(endpoint.url.rsplit(":", 1)[1])), timeout=2).close()


def test_the_endpoint_refuses_web_pages_and_foreign_hosts(tmp_path: Path) -> None:
    endpoint = MetricsEndpoint(0, run_id="r")
    port = int(endpoint.url.rsplit(":", 1)[1])
    try:
        for headers in ({"Origin": "http://evil.example"}, {"Host": "evil.example"}):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(raw_request("GET", "/metrics", port=port, headers=headers))
                assert [status for status, _, _ in read_responses(sock, quiet_s=0.5)] == [403]
    finally:
        endpoint.close()


@pytest.mark.slow
def test_a_training_run_exposes_its_step_metrics_while_it_runs(tmp_path: Path, _rlctl_home: Path) -> None:
    run_dir = tmp_path / "run"
    env = {"OMP_NUM_THREADS": "1", "RLCTL_HOME": str(_rlctl_home), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-m", "rlctl.cli.app", "train", "configs/quickstart.yaml", *TINY_OVERRIDES,
                             "train.steps=40", "eval.at_end=false", "train.metrics_port=0", "--run-dir", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    seen: dict = {}
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and "rlctl_train_step" not in seen:
            time.sleep(0.2)
            url = run_dir / "metrics.url"
            if url.exists():
                try:
                    seen = scrape(url.read_text().strip())
                except OSError:
                    pass
        assert proc.poll() is None, "the run ended before its metrics were scraped"  # scraped *while* it runs
        assert seen["rlctl_train_step"][1] >= 0 and "rlctl_train_reward_math" in seen, sorted(seen)
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    logged = {json.loads(line)["step"]: json.loads(line)["metrics"] for line in
              (run_dir / "metrics.jsonl").read_text().splitlines()}
    step = int(seen["rlctl_train_step"][1])
    assert seen["rlctl_train_reward_mean"][1] == pytest.approx(logged[step]["reward_mean"])  # the logged metrics
    assert seen["rlctl_train_reward_math"][1] == pytest.approx(logged[step]["reward/math"])
