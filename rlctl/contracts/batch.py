"""The learner's input: trajectories packed into padded tensors.

What this is: a frozen dataclass of tensors plus the per-row bookkeeping a
learner needs. Built by rlctl.engine.batching from Trajectory objects.

What this is not: a data loader. Tensors are annotated as torch Tensors under
TYPE_CHECKING only, so that importing the contracts never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlctl.contracts.types import SamplingConfig

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainBatch:
    """N sequences (prompt + response), right-padded to length T.

    Token-level tensors are aligned so that position t holds token t; the
    logprob of token t is predicted from position t-1. ``action_mask`` is 1 on
    response tokens that are trained on (never on prompt or padding, nor on a
    multi-turn episode's environment tokens, which sit between its policy
    turns: the mask can have zeros in the middle of a response).
    """

    input_ids: Tensor  # [N, T] long
    attention_mask: Tensor  # [N, T] long, 1 on real tokens
    action_mask: Tensor  # [N, T] float, 1 on trained response tokens
    behavior_logprobs: Tensor  # [N, T] float32, log mu, 0 outside action_mask
    advantages: Tensor  # [N, T] float32, per-token advantage (GRPO: the sequence's, broadcast)
    sampling: SamplingConfig
    trajectory_ids: tuple[str, ...]
    policy_versions: tuple[int, ...]
    ref_logprobs: Tensor | None = None  # [N, T] when the KL reference is used
    old_logprobs: Tensor | None = None  # [N, T] learner's pre-update log-probs (truncated importance sampling)

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: Any) -> "TrainBatch":
        """The same batch with every tensor on ``device`` (itself when they already are)."""
        if self.input_ids.device == device:
            return self
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TrainBatch(
            input_ids=move(self.input_ids), attention_mask=move(self.attention_mask),
            action_mask=move(self.action_mask), behavior_logprobs=move(self.behavior_logprobs),
            advantages=move(self.advantages), sampling=self.sampling, trajectory_ids=self.trajectory_ids,
            policy_versions=self.policy_versions, ref_logprobs=move(self.ref_logprobs),
            old_logprobs=move(self.old_logprobs),
        )

    def select(self, rows: Any) -> "TrainBatch":
        """Sub-batch of the given row indices (a list or a long tensor)."""
        idx = [int(i) for i in rows]
        take = lambda t: None if t is None else t[idx]  # noqa: E731
        return TrainBatch(
            input_ids=take(self.input_ids),
            attention_mask=take(self.attention_mask),
            action_mask=take(self.action_mask),
            behavior_logprobs=take(self.behavior_logprobs),
            advantages=take(self.advantages),
            sampling=self.sampling,
            trajectory_ids=tuple(self.trajectory_ids[i] for i in idx),
            policy_versions=tuple(self.policy_versions[i] for i in idx),
            ref_logprobs=take(self.ref_logprobs),
            old_logprobs=take(self.old_logprobs),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class AdvantageInputs:
    """What an advantage estimator reads for one step: B prompts x G samples, N = B * G rows.

    Rows are grouped (the G samples of prompt b are rows b*G .. b*G+G-1).
    ``token_kl`` is the per-token KL(pi_old || ref) estimate when the KL goes
    into the reward (else None; ``kl_coef`` scales it); ``values`` the
    critic's per-token values when the estimator needs a critic. ``rewards``
    are episode returns: the grader's reward plus the per-turn rewards of a
    multi-turn episode (rlctl.engine.batching.episode_return), which
    ``turn_rewards`` also lays out per token, at the policy token that earned
    each (None when no episode has one): an estimator that works per token
    places those there and the rest of the return on the last policy token
    (rlctl.algo.outcome_token_rewards); an outcome estimator uses ``rewards``.
    """

    rewards: Any  # [B, G] float32, NaN allowed where not valid
    valid: Any  # [B, G] bool
    action_mask: Any  # [N, T] float, 1 on the policy's response tokens (0 on an episode's environment tokens)
    token_kl: Any | None = None  # [N, T]
    kl_coef: float = 0.0
    values: Any | None = None  # [N, T]
    turn_rewards: Any | None = None  # [N, T]: per-turn rewards, already inside ``rewards``
