"""Per-step metrics under stable names (the names are an interface: sinks, dashboards and tests read them).

What this is: a pure function from one step's scored trajectories, learner
statistics and stage times to a flat ``{name: value}`` dict.

What this is not: storage (metric sinks) or display (the CLI).

Names: reward_mean, reward_std, reward/<component>, kl_ref, entropy,
response_length_mean/max, truncated_frac, clip_fraction, grad_norm, loss,
nan_inf_skipped_steps, reward_error_count, reward_error_frac, groups_dropped, reward_length_corr, T_r, T_v, T_l, T_s, step_time_s,
generated_tokens_per_s, learned_tokens_per_s, esr, effective_tokens_per_s,
verifier_latency_p50/p95/p99_s, staleness_mean/max, frac_zero_std,
logprob_mismatch_mean/max, policy_version, rollout_sequences, the episode
names (``episode_metrics``: episode_turns_mean, episode_tool_calls,
episode_tool_retries, episode_tool_call_rate, episode_tool_error_rate,
episode_turn_cap_rate, episode_env_tokens, episode_turn_reward,
episode_dropped_groups, time_tool_s, time_tool_frac; 0 for single-turn
samples); the length and token-rate names count the policy's tokens
(an episode's environment tokens are episode_env_tokens),
rollout_prompt/real/computed/prefill_tokens, rollout_padding_waste (the torch
learner adds learner_real/computed/flop_tokens, learner_padding_waste); and
in every mode the overlap and
driver names (``overlap_metrics``, ``DRIVER_METRICS``), 0 where a mode has
no such thing (a synchronous run has no queue). The step end
(rlctl.engine.loop.StepEnd) adds rl_seconds_total, the machine-load names
(``MachineLoad``) and, at an eval step, the periodic eval's eval_dev_*.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

from rlctl.contracts.episodes import FAILED_TOOL_STATUSES
from rlctl.contracts.types import TerminalReason, Trajectory, Writer


def step_metrics(*, scored: Sequence[Trajectory], learner_stats: Mapping[str, float], adv_stats: Mapping[str, float],
                 advantages: Any, verify_latencies: Sequence[float], learner_version: int,
                 times: Mapping[str, float], trained_version: int | None = None,
                 dropped: Sequence[Trajectory] = (), group_size: int = 1) -> dict[str, float]:
    """One step's metrics. ``trained_version``: the learner's policy version the batch was trained
    against (before the update; default ``learner_version - 1``); staleness is measured from it, so a
    step whose update was skipped does not report negative staleness. ``dropped``: the trajectories of
    groups dropped before training (generated, never learned from; counted in ESR and tokens/s)."""
    base = learner_version - 1 if trained_version is None else trained_version
    ok = [t for t in scored if t.reward_error is None]
    rewards = [float(t.reward) for t in ok if t.reward is not None]
    lengths = [t.num_policy_tokens for t in scored]  # an episode's environment tokens: episode_env_tokens
    generated = sum(lengths) + sum(t.num_policy_tokens for t in dropped)
    num_generated = len(scored) + len(dropped)
    informative = (advantages.flatten() != 0).tolist()
    learned = sum(n for n, keep in zip(lengths, informative) if keep)
    useful = sum(1 for t, keep in zip(scored, informative) if keep and t.reward_error is None)
    step_time = sum(times.values())
    out: dict[str, float] = {
        "reward_mean": _mean(rewards),
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "response_length_mean": _mean(lengths),
        "response_length_max": float(max(lengths, default=0)),
        "truncated_frac": _mean([t.terminal_reason is TerminalReason.LENGTH for t in scored]),
        "reward_error_count": float(num_generated - len(ok)),
        "reward_error_frac": (num_generated - len(ok)) / num_generated if num_generated else 0.0,
        "groups_dropped": float(len(dropped) // max(group_size, 1)),
        "generated_tokens_per_s": generated / times["T_r"] if times["T_r"] > 0 else 0.0,
        "learned_tokens_per_s": learned / times["T_l"] if times["T_l"] > 0 else 0.0,
        "esr": useful / num_generated if num_generated else 0.0,
        "step_time_s": step_time,
        "policy_version": float(learner_version),
        "staleness_mean": _mean([base - t.policy_version for t in scored]),
        "staleness_max": float(max((base - t.policy_version for t in scored), default=0)),
    }
    out["effective_tokens_per_s"] = out["generated_tokens_per_s"] * out["esr"]
    out["reward_length_corr"] = _corr(rewards, [t.num_policy_tokens for t in ok if t.reward is not None])
    for name in sorted({k for t in ok for k in t.reward_components}):
        out[f"reward/{name}"] = _mean([t.reward_components.get(name, 0.0) for t in ok])
    for q, label in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
        out[f"verifier_latency_{label}_s"] = _quantile(verify_latencies, q)
    out.update(rollout_tokens([*scored, *dropped]))
    out.update(episode_metrics([*scored, *dropped], dropped, group_size, step_time))
    out.update({k: float(v) for k, v in times.items()})
    out.update({k: float(v) for k, v in adv_stats.items()})
    out.update({k: float(v) for k, v in learner_stats.items()})
    return out


def rollout_tokens(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """What generating ``trajectories`` computed (``rlctl profile``'s roofline and padding waste).

    A batched decode runs every row until the longest response ends, so it computes about rows x longest
    response tokens for the real (generated) ones: an upper bound where an engine compacts finished rows
    (the local engine does once a quarter of the batch has finished). Prefill: each distinct prompt once.
    Episodes: real and computed count the policy's (decoded) tokens only; the environment's tokens are
    prefilled, never decoded, so they count in the prefill (once each: an engine without a prefix cache
    prefills an episode's context again every turn, which is not counted).
    """
    real = sum(t.num_policy_tokens for t in trajectories)
    computed = len(trajectories) * max((t.num_policy_tokens for t in trajectories), default=0)
    prompts = {t.prompt_id: len(t.prompt_tokens) for t in trajectories}
    env = sum(t.num_response_tokens - t.num_policy_tokens for t in trajectories)
    return {"rollout_sequences": float(len(trajectories)),
            "rollout_prompt_tokens": float(sum(len(t.prompt_tokens) for t in trajectories)),
            "rollout_real_tokens": float(real), "rollout_computed_tokens": float(computed),
            "rollout_prefill_tokens": float(sum(prompts.values()) + env),
            "rollout_padding_waste": 1.0 - real / computed if computed else 0.0}




def episode_metrics(trajectories: Sequence[Trajectory], dropped: Sequence[Trajectory] = (), group_size: int = 1,
                    step_time_s: float = 0.0) -> dict[str, float]:
    """What the step's episodes did: turns, tool calls and their failures, limits hit, tool time.

    ``trajectories``: every episode generated this step (the dropped ones included); ``dropped``: the
    trajectories of the groups dropped whole (``group_size`` each). A single-turn sample is one policy turn
    with no tool call. A call is an environment turn that ran a tool (or whose step failed or was retried: a
    crashed or hung environment); it stands for ``1 + tool_retries`` attempts (Turn.tool_retries: failed attempts the
    driver ran again). ``episode_tool_calls``, ``episode_tool_retries`` and ``episode_env_tokens`` are totals
    over the step; ``episode_tool_error_rate`` = failed attempts (tool_status timeout / error / garbage, the
    retried ones included: a failure a retry recovered counts) / attempts;
    ``episode_turn_cap_rate``: episodes that ended at ``max_turns`` or ``max_total_tokens``
    (TerminalReason.LENGTH of a multi-turn episode); ``episode_dropped_groups``: dropped groups with a failed
    tool call; ``time_tool_s``: seconds inside tool calls, every attempt's, summed over the episodes (calls
    that ran concurrently each count), and ``time_tool_frac`` that over ``step_time_s`` (the tool latency
    share); ``episode_turn_reward``: the mean over episodes of their per-turn rewards' sum (Turn.reward, the
    part of an episode's return the grader's ``reward_mean`` leaves out).
    """
    calls = attempts = failed = retries = env_tokens = with_call = capped = 0
    turns: list[float] = []
    tool_s = turn_reward = 0.0
    for t in trajectories:
        env = [u for u in t.turns if u.tool is not None or u.tool_status in FAILED_TOOL_STATUSES or u.tool_retries]
        calls += len(env)
        retries += sum(u.tool_retries for u in env)
        attempts += sum(1 + u.tool_retries for u in env)
        failed += sum(u.tool_retries + (u.tool_status in FAILED_TOOL_STATUSES) for u in env)
        turn_reward += sum(u.reward for u in t.turns if u.reward is not None)
        with_call += bool(env)
        tool_s += sum(u.tool_seconds for u in t.turns)
        env_tokens += sum(u.end - u.start for u in t.turns if u.writer is Writer.ENV)
        turns.append(float(sum(1 for u in t.turns if u.writer is Writer.POLICY) if t.turns else 1))
        capped += bool(t.turns) and t.terminal_reason is TerminalReason.LENGTH
    g = max(group_size, 1)
    groups = [dropped[i:i + g] for i in range(0, len(dropped), g)]
    n = len(trajectories)
    return {"episode_turns_mean": _mean(turns), "episode_tool_calls": float(calls),
            "episode_tool_retries": float(retries), "episode_turn_reward": turn_reward / n if n else 0.0,
            "episode_tool_call_rate": with_call / n if n else 0.0,
            "episode_tool_error_rate": failed / attempts if attempts else 0.0,
            "episode_turn_cap_rate": capped / n if n else 0.0, "episode_env_tokens": float(env_tokens),
            "episode_dropped_groups": float(sum(1 for group in groups if any(tool_failed(t) for t in group))),
            "time_tool_s": tool_s, "time_tool_frac": tool_s / step_time_s if step_time_s > 0 else 0.0}


def tool_failed(trajectory: Trajectory) -> bool:
    """Whether a tool call of the episode timed out, crashed or returned garbage (the episode is flagged)."""
    return (any(u.tool_status in FAILED_TOOL_STATUSES for u in trajectory.turns)
            or (trajectory.reward_error or "").startswith("tool_"))


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _corr(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson correlation (0 when either side is constant): a reward that tracks length is a hacking sign."""
    if len(xs) < 2:
        return 0.0
    mx, my = _mean(xs), _mean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return float(sxy / (sxx * syy) ** 0.5) if sxx > 0 and syy > 0 else 0.0


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


# What a loop driver reports besides the step's own metrics; every mode writes every name (0 when it has no such
# thing: the synchronous loop has no queue, the overlapped one no refill rounds), so runs compare name for name.
DRIVER_METRICS = (
    "generated_tokens", "generated_tokens_total", "groups_trained",
    "ds_dropped_groups", "ds_refill_prompts", "ds_sample_rounds", "ds_short_groups",
    "verifier_fail_frac", "verifier_retries", "verifier_recovered",
    "learner_wait_s", "rollout_wait_s", "queue_depth", "queue_age_s", "queue_duplicates",
    "queue_drops_stale", "queue_drops_ttl", "queue_drops_orphaned", "reweighted_groups",
    "rollout_worker_failures", "requeued_prompts", "learner_restarts", "partial_carried_groups",
)


def overlap_metrics(*, staleness: Sequence[int], dlag: Sequence[float], latencies: Sequence[float],
                    bound: int) -> dict[str, float]:
    """dv, D_lag and rollout-latency percentiles plus bound violations; the same names in every mode."""
    out: dict[str, float] = {}
    for q, label in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
        out[f"staleness_{label}"] = _quantile([float(x) for x in staleness], q)
        out[f"dlag_{label}"] = _quantile(list(dlag), q)
        out[f"rollout_latency_{label}_s"] = _quantile(list(latencies), q)
    out["staleness_mean"] = float(sum(staleness) / len(staleness)) if staleness else 0.0
    out["staleness_max"] = float(max(staleness, default=0))
    out["staleness_violations"] = float(sum(1 for x in staleness if x > bound))
    return out


class MachineLoad:
    """How busy the machine was over each step, for telling a busy machine from a slow engine (rlctl diagnose).

    ``sample()`` (once per step, at its end): ``host_load_per_cpu``, the 1-minute
    load average over the CPU count (above 1: more runnable threads than CPUs,
    from any process), and ``process_cpu_frac``, this process's CPU seconds (all
    threads) over the wall seconds since the previous sample. Two system calls.
    """

    def __init__(self) -> None:
        import os
        import time

        self._cpus = os.cpu_count() or 1
        self._last = (time.perf_counter(), time.process_time())

    def sample(self) -> dict[str, float]:
        import os
        import time

        now = (time.perf_counter(), time.process_time())
        wall, cpu = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        out = {"process_cpu_frac": cpu / wall if wall > 0 else 0.0}
        try:
            out["host_load_per_cpu"] = os.getloadavg()[0] / self._cpus
        except (OSError, AttributeError):  # no load average on this platform: the metric is not recorded
            pass
        return out
