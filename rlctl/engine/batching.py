"""Data order and batch assembly: the prompt cursor and Trajectory -> TrainBatch.

What this is: ``PromptCursor`` (seeded epoch shuffling with a resumable
position: the data cursor a checkpoint stores) and ``build_batch`` (pads
prompt+response sequences on the right and aligns behaviour log-probs and
advantages with the tokens they belong to).

What this is not: rollout or scoring.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from rlctl.contracts.batch import TrainBatch
from rlctl.contracts.types import PromptRecord, SamplingConfig, Trajectory, Writer


@dataclass
class CursorState:
    epoch: int = 0
    position: int = 0


class PromptCursor:
    """Yields train prompts in a seeded order, epoch after epoch, and can resume exactly."""

    def __init__(self, records: Sequence[PromptRecord], seed: int, state: CursorState | None = None,
                 batch_size: int = 1, length_window: int = 0) -> None:
        if not records:
            raise ValueError("the train split is empty; a task needs at least one train prompt")
        self.records = tuple(records)
        self.seed = seed
        self.batch_size, self.length_window = batch_size, length_window
        self.state = CursorState(state.epoch, state.position) if state else CursorState()  # never alias

    def _order(self, epoch: int) -> list[int]:
        cached = getattr(self, "_cached", None)  # record_at asks per prompt: keep the last epoch's order
        if cached is not None and cached[0] == epoch:
            return cached[1]
        order = list(range(len(self.records)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        if self.length_window > 1:
            order = self._length_grouped(order, random.Random(f"{self.seed}/{epoch}/lengths"))
        self._cached = (epoch, order)
        return order

    def _length_grouped(self, order: list[int], rng: random.Random) -> list[int]:
        """Length-aware batching: within each window of ``length_window`` batches of the shuffled
        order, sort by prompt length (characters) so each batch holds similar lengths (less padding),
        then shuffle the batches of the window so steps do not run short-to-long. A pure function
        of seed and epoch, so a resumed cursor continues the same order."""
        b, out = self.batch_size, []
        span = b * self.length_window
        for start in range(0, len(order), span):
            window = sorted(order[start:start + span], key=lambda i: len(self.records[i].text))
            batches = [window[j:j + b] for j in range(0, len(window), b)]
            rng.shuffle(batches)
            out.extend(i for batch in batches for i in batch)
        return out

    def record_at(self, index: int) -> PromptRecord:
        """The prompt at position ``index`` of the endless seeded order (epoch ``index // len``); no state change."""
        epoch, position = divmod(index, len(self.records))
        return self.records[self._order(epoch)[position]]

    def next(self, count: int) -> list[PromptRecord]:
        out: list[PromptRecord] = []
        while len(out) < count:
            order = self._order(self.state.epoch)
            take = min(count - len(out), len(order) - self.state.position)
            out.extend(self.records[i] for i in order[self.state.position:self.state.position + take])
            self.state.position += take
            if self.state.position == len(order):
                self.state = CursorState(epoch=self.state.epoch + 1, position=0)
        return out


def build_batch(trajectories: Sequence[Trajectory], advantages: Sequence[float], pad_id: int,
                sampling: SamplingConfig) -> TrainBatch:
    """Right-padded [N, T] tensors; the response of row i starts right after its prompt.

    An episode's row holds every token after its prompt, the environment's
    included, in order; its action mask (0 on the environment's tokens) and
    behaviour log-probs come from the trajectory as they are, and its
    advantage is set on every response position: what is trained is decided
    by the action mask alone (the estimators zero the advantages outside it).
    """
    import torch

    n = len(trajectories)
    width = max(len(t.prompt_tokens) + len(t.response_tokens) for t in trajectories)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    act = torch.zeros((n, width), dtype=torch.float32)
    behav = torch.zeros((n, width), dtype=torch.float32)
    adv = torch.zeros((n, width), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_tokens), len(t.response_tokens)
        ids[i, : p + r] = torch.tensor(t.prompt_tokens + t.response_tokens, dtype=torch.long)
        attn[i, : p + r] = 1
        act[i, p: p + r] = torch.tensor(t.action_mask, dtype=torch.float32)
        behav[i, p: p + r] = torch.tensor(t.behavior_logprobs, dtype=torch.float32)
        adv[i, p: p + r] = float(advantages[i])
    return TrainBatch(
        input_ids=ids, attention_mask=attn, action_mask=act, behavior_logprobs=behav, advantages=adv,
        sampling=sampling, trajectory_ids=tuple(t.id for t in trajectories),
        policy_versions=tuple(t.policy_version for t in trajectories),
    )


def sampled_lengths(trajectories: Sequence[Trajectory]) -> list[int]:
    """The length each sample was sampled up to, what length shaping (DAPO's overlong penalty) compares with
    ``rollout.max_tokens``: a single-turn sample's response, an episode's longest policy turn.

    Every policy turn of an episode is one generation capped at ``max_tokens``;
    the environment's tokens and the number of turns are not the policy's
    length, so a tool-using episode is not punished for being one.
    """
    return [max((t.end - t.start for t in traj.turns if t.writer is Writer.POLICY), default=0) if traj.turns
            else traj.num_response_tokens for traj in trajectories]


def episode_return(trajectory: Trajectory) -> float | None:
    """What a sample's advantage is computed from: the grader's reward plus, for an episode, its per-turn rewards.

    ``Trajectory.reward`` is the grader's total on the final answer (or the
    truncation penalty); the environment's per-turn reward parts live on the
    turns (``Turn.reward``) and are never part of it, so the sum counts each
    once. None when the sample is unscored.
    """
    if trajectory.reward is None:
        return None
    return float(trajectory.reward) + sum(t.reward for t in trajectory.turns if t.reward is not None)


def turn_rewards(trajectories: Sequence[Trajectory], width: int) -> Any:
    """[N, width] per-turn rewards where they were earned, aligned with ``build_batch``'s rows; None when no
    trajectory has one.

    A turn's reward sits on the last policy token before the turn ends (the
    policy turn the environment answered: its last token; an environment
    turn: the policy token before it), or on the first policy token when none
    comes before. Token-level estimators (GAE, REINFORCE++) place it there and
    the rest of the episode's return on the last policy token
    (rlctl.algo.outcome_token_rewards); outcome estimators only see the sum.
    """
    import torch

    if not any(u.reward is not None for t in trajectories for u in t.turns):
        return None
    out = torch.zeros((len(trajectories), width), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        policy = [j for j, m in enumerate(t.action_mask) if m]
        p = len(t.prompt_tokens)
        for u in t.turns:
            if u.reward is None or not policy:
                continue
            before = [j for j in policy if j < u.end]
            out[i, p + (before[-1] if before else policy[0])] += u.reward
    return out


def group_rewards(trajectories: Sequence[Trajectory], group_size: int) -> tuple[Any, Any]:
    """[B, G] rewards (each sample's ``episode_return``) and validity masks; the rollout keeps a prompt's G
    samples adjacent."""
    import torch

    if len(trajectories) % group_size:
        raise ValueError(f"{len(trajectories)} trajectories do not form groups of {group_size}")
    b = len(trajectories) // group_size
    for g in range(b):
        ids = {t.prompt_id for t in trajectories[g * group_size:(g + 1) * group_size]}
        if len(ids) != 1:
            raise ValueError(f"group {g} mixes prompts {sorted(ids)}: the G samples of a prompt must stay together")
    valid = torch.tensor([t.reward_error is None for t in trajectories]).view(b, group_size)
    returns = [episode_return(t) for t in trajectories]
    rewards = torch.tensor([r if r is not None else float("nan") for r in returns],
                           dtype=torch.float32).view(b, group_size)
    return rewards, valid


def drop_unscored_groups(trajectories: Sequence[Trajectory], group_size: int) -> tuple[list[Trajectory], list[Trajectory]]:
    """``(kept, dropped)``: a group with any sample lacking a reward is dropped whole, never trained partially.

    A partial group would compute its baseline from the samples that happened
    to be scored and so shift every advantage in it; the dropped samples are
    counted by the caller (``groups_dropped``), never scored as zero.
    """
    kept: list[Trajectory] = []
    dropped: list[Trajectory] = []
    for g in range(0, len(trajectories), group_size):
        group = trajectories[g:g + group_size]
        (dropped if any(t.reward_error is not None for t in group) else kept).extend(group)
    return kept, dropped
