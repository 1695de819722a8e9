"""The built-in advantage estimators: thin compositions of the pure functions in rlctl.algo.

What this is: one small class per estimator (the AdvantageEstimator protocol):
how rewards become per-token advantages, which policy loss and aggregation go
with them, and the reward-side steps some of them add (DAPO's group filter and
overlong penalty).

What this is not: tensor maths (rlctl.algo) or the loop that calls them
(rlctl.engine). A third-party estimator looks exactly like these.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

import rlctl.kit.algo as F  # the tensor maths, by its public names (rlctl/algo/__init__.py lists them once)
from rlctl import AdvantageInputs, ConfigError


def broadcast(per_sequence: Tensor, action_mask: Tensor) -> Tensor:
    """``[B, G]`` sequence advantages onto the trained tokens of ``[N, T]`` rows (0 elsewhere: prompt, padding,
    an episode's environment tokens)."""
    return per_sequence.reshape(-1, 1).float() * (action_mask > 0)


class _Outcome:
    """Shared defaults: token PPO clip, token-mean aggregation, no critic, no reward shaping or filtering."""

    policy_loss = "token"
    loss_agg = "token-mean"
    clip: tuple[float, float] | None = None
    needs_critic = False
    kl_in_token_rewards = False
    max_sample_rounds = 1
    min_group_size = 2  # the group is the baseline

    def __init__(self, algo: Any, options: Any = None) -> None:
        self.algo = algo
        self.options = options

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_tokens: int) -> Tensor:
        return rewards

    def keep_groups(self, rewards: Tensor, valid: Tensor) -> Tensor:
        return torch.ones(rewards.shape[0], dtype=torch.bool)

    def value_targets(self, inputs: AdvantageInputs) -> Tensor | None:
        return None


class GRPO(_Outcome):
    """Group-relative: (r - group mean) / group std, the sequence's value on each of its tokens."""

    def advantages(self, inputs: AdvantageInputs) -> tuple[Tensor, Mapping[str, float]]:
        adv, stats = F.grpo_advantages(inputs.rewards, inputs.valid, normalize_std=self.algo.normalize_std)
        return broadcast(adv, inputs.action_mask), stats


class DrGRPO(_Outcome):
    """GRPO without the two normalisations: no group std, and a constant (max length) loss divisor."""

    loss_agg = "seq-mean-token-sum-norm"

    def advantages(self, inputs: AdvantageInputs) -> tuple[Tensor, Mapping[str, float]]:
        adv, stats = F.grpo_advantages(inputs.rewards, inputs.valid, normalize_std=False)
        return broadcast(adv, inputs.action_mask), stats


class RLOO(_Outcome):
    """Leave-one-out baseline: each sample against the mean of the other G - 1."""

    def advantages(self, inputs: AdvantageInputs) -> tuple[Tensor, Mapping[str, float]]:
        adv, stats = F.rloo_advantages(inputs.rewards, inputs.valid)
        return broadcast(adv, inputs.action_mask), stats


class ReinforcePP(_Outcome):
    """REINFORCE++: token returns with the KL penalty in the reward, whitened over the whole batch."""

    kl_in_token_rewards = True
    min_group_size = 1  # the batch is the baseline

    def advantages(self, inputs: AdvantageInputs) -> tuple[Tensor, Mapping[str, float]]:
        return F.reinforce_pp_advantages(inputs.rewards.reshape(-1), inputs.action_mask, inputs.valid.reshape(-1),
                                         inputs.token_kl, inputs.kl_coef, turn_rewards=inputs.turn_rewards)


class _OwnClip(GRPO):
    """An estimator whose clip range is its ``algo.options.clip_low/clip_high``, never ``algo.clip_eps``.

    A ``clip_eps`` other than the default (or any ``clip_eps_high``) would be
    silently ignored, so it is a config error naming the key that is read.
    """

    def __init__(self, algo: Any, options: Any = None) -> None:
        super().__init__(algo, options)
        default = type(algo).model_fields["clip_eps"].default
        for key, value, unset in (("clip_eps", algo.clip_eps, default), ("clip_eps_high", algo.clip_eps_high, None)):
            if value != unset:
                raise ConfigError(
                    f"algo.{key}={value} is not used by {algo.name}: its clip range is "
                    f"algo.options.clip_low / clip_high (now {options.clip_low} / {options.clip_high})",
                    f"remove algo.{key} and set algo.options.{'clip_low' if key == 'clip_eps' else 'clip_high'} "
                    f"if you need another clip")

    @property
    def clip(self) -> tuple[float, float]:
        return (self.options.clip_low, self.options.clip_high)


class GSPO(_OwnClip):
    """Group-normalised advantages with one importance ratio and clip decision per sequence."""

    policy_loss = "sequence"


class DAPO(_OwnClip):
    """GRPO with clip-higher, token-level loss, dynamic sampling and the soft overlong penalty."""

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_tokens: int) -> Tensor:
        if not self.options.overlong_buffer or not self.options.overlong_penalty:
            return rewards
        buffer = min(self.options.overlong_buffer, max_tokens)
        return rewards + F.overlong_penalty(lengths, max_tokens, buffer, self.options.overlong_penalty)

    def keep_groups(self, rewards: Tensor, valid: Tensor) -> Tensor:
        if not self.options.dynamic_sampling:
            return super().keep_groups(rewards, valid)
        return F.informative_groups(rewards, valid)

    @property
    def max_sample_rounds(self) -> int:
        return self.options.max_sample_rounds if self.options.dynamic_sampling else 1


class PPO(_Outcome):
    """PPO with a critic: per-token rewards (outcome at the end, KL penalty per token), GAE, whitened.

    An episode's environment tokens are not steps: each per-turn reward goes on the last policy token before
    its environment turn, the rest of the return on the last policy token, and GAE runs over the policy tokens
    only (rlctl.algo.gae), so the critic's targets are 0 off the action mask.
    """

    needs_critic = True
    kl_in_token_rewards = True
    min_group_size = 1  # the critic is the baseline

    def _gae(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor, Tensor]:
        if inputs.values is None:
            raise ValueError("ppo needs the critic's values; the engine must build the critic role")
        valid = inputs.valid.reshape(-1)  # [N]
        mask = (inputs.action_mask > 0) & valid.view(-1, 1)  # [N, T]
        rewards = torch.where(valid, inputs.rewards.reshape(-1).float(), torch.zeros(()))  # [N]
        token_r = F.outcome_token_rewards(rewards, mask, inputs.token_kl, inputs.kl_coef, inputs.turn_rewards)
        critic = self.algo.critic
        adv, returns = F.gae(token_r, inputs.values, mask, critic.gamma, critic.lam)
        return adv, returns, mask

    def advantages(self, inputs: AdvantageInputs) -> tuple[Tensor, Mapping[str, float]]:
        adv, returns, mask = self._gae(inputs)
        return F.whiten(adv, mask), {"returns_mean": float(returns[mask].mean()) if mask.any() else 0.0}

    def value_targets(self, inputs: AdvantageInputs) -> Tensor:
        """GAE returns A + V (before whitening): what the critic regresses onto."""
        return self._gae(inputs)[1]
