"""Parallel reward workers (rlctl.engine.reward_pool): order, retries, deadlines, and the scoring path."""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import pytest

from rlctl import RewardResult, SamplingConfig, TerminalReason, Trajectory
from rlctl.engine.reward_pool import ProcessRewardPool
from rlctl.engine.scoring import score_all


def traj(i: int, text: str, reason: TerminalReason = TerminalReason.EOS) -> Trajectory:
    return Trajectory.create(
        id=f"p{i}/0", prompt_id=f"p{i}", group_index=0, dataset_version="d", policy_version=0,
        tokenizer_hash="t", prompt_tokens=(1,), response_tokens=(2,), response_text=text, action_mask=(1,),
        behavior_logprobs=(-0.1,), sampling_config=SamplingConfig(max_tokens=4), terminal_reason=reason,
        rollout_started_at=0.0,
    )


class ScriptedGrader:
    """Scores int(text) / 100; "hang" sleeps forever; "flaky:<dir>" fails as infra once per marker file;
    "die" kills its own worker process."""

    name = "scripted"
    version = "scripted@1"

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        text = trajectory.response_text
        if text == "hang":
            time.sleep(3600)
        if text == "die":
            os._exit(3)
        if text.startswith("flaky:"):
            marker = Path(text.split(":", 1)[1]) / trajectory.prompt_id
            if not marker.exists():
                marker.write_text("failed once")
                return RewardResult(total=0.0, components={}, grader_version=self.version,
                                    error_code="sandbox_error", log="jail did not start")
            return RewardResult(total=1.0, components={"s": 1.0}, grader_version=self.version, log="retried")
        time.sleep(0.01 * (int(text) % 3))  # uneven latency: completion order differs from input order
        return RewardResult(total=int(text) / 100, components={"s": int(text) / 100}, grader_version=self.version)


@pytest.fixture(scope="module")
def pool():
    with ProcessRewardPool(partial(ScriptedGrader), workers=2, timeout_s=2.0, retries=1) as p:
        yield p


def test_results_in_input_order(pool: ProcessRewardPool) -> None:
    texts = [str(i) for i in range(20)]
    results = pool.score([traj(i, t) for i, t in enumerate(texts)], ["ref"] * 20)
    assert [r.total for r in results] == [i / 100 for i in range(20)]
    assert all(r.error_code is None for r in results)


def test_infra_error_is_retried(pool: ProcessRewardPool, tmp_path: Path) -> None:
    results = pool.score([traj(i, f"flaky:{tmp_path}") for i in range(3)], ["ref"] * 3)
    assert [r.total for r in results] == [1.0, 1.0, 1.0]
    assert all(r.error_code is None and "attempt 2" in r.log for r in results)


def test_timeout_is_flagged_never_zero_and_pool_recovers(pool: ProcessRewardPool) -> None:
    started = time.perf_counter()
    results = pool.score([traj(0, "5"), traj(1, "hang"), traj(2, "7")], ["r"] * 3)
    assert results[1].error_code == "timeout"
    assert [results[0].total, results[2].total] == [0.05, 0.07]
    assert time.perf_counter() - started < 30
    assert pool.score([traj(3, "9")], ["r"])[0].total == 0.09  # the replaced worker answers


def test_dead_worker_is_retried_then_flagged(pool: ProcessRewardPool) -> None:
    results = pool.score([traj(0, "die"), traj(1, "4")], ["r", "r"])
    assert results[0].error_code == "worker_crashed" and results[0].total == 0.0
    assert results[1].total == 0.04


def test_score_all_through_pool_matches_in_process(pool: ProcessRewardPool) -> None:
    trajs = [traj(i, str(i)) for i in range(6)] + [traj(6, "1", TerminalReason.ABORT)]
    refs = {t.prompt_id: "r" for t in trajs}
    via_pool, _ = score_all(trajs, refs, ScriptedGrader(), None, pool=pool)
    in_proc, _ = score_all(trajs, refs, ScriptedGrader(), None)
    assert [t.reward for t in via_pool] == [t.reward for t in in_proc]
    assert via_pool[-1].reward_error == "aborted"
