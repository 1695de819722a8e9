"""Shared test helpers: one rollout batch from a session, and its logprob mismatch."""

from __future__ import annotations

from rlctl.contracts.types import RolloutRequest


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
