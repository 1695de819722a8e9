"""Benchmark: rlctl's learner step vs a minimal hand-written PyTorch GRPO step on the same batch (CPU).

Run:  OMP_NUM_THREADS=1 python bench/learner_overhead.py [--repeats 9] [--prompts 16] [--group 8] [--max-tokens 12]

Setup: the quickstart's tiny model warm-started by rlctl (cached under RLCTL_HOME, shared with
bench/grpo_vs_trl.py), one real rollout batch of B x G sequences from rlctl's local engine, advantages +1/-1
alternating (every sequence informative). Three steps run on that batch, interleaved, each from its own copy of
the same weights and a fresh AdamW (lr 5e-5, betas 0.9/0.99, grad clip 1.0):

- ``rlctl learner``: ``TorchLearner.train_step`` (the plugin the loop calls: PPO-clip loss, token-mean,
  entropy and logprob-mismatch statistics, NaN guard, LR schedule).
- ``rlctl loop learner stage``: what the loop's T_l covers on top: ``build_batch`` (once, as the loop
  does), GRPO advantages broadcast onto the batch's response tokens, then ``train_step``.
- ``minimal``: the same maths hand-written in ~15 lines (forward, log-softmax gather, clipped ratio,
  token-mean, backward, clip, AdamW step), no statistics.
- ``minimal, prompt shared``: the minimal step written to forward each prompt once per group (its KV
  cache reused by the G responses, gradients flowing through it) with logits only on response positions:
  the hand-written counterpart of what the torch learner does by default (``share_prompt_prefill``), so
  ``rlctl learner`` should be compared with this row.

Each figure is the median over ``--repeats`` interleaved repeats; ratios are taken in the same run.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import REPO  # noqa: E402  (one thread, offline; must precede torch)

import torch  # noqa: E402

from rlctl.models.compat import kv_cache_name  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--warm-start-steps", type=int, default=300)
    p.add_argument("--home", default=os.environ.get("RLCTL_HOME", str(Path("~/.rlctl").expanduser())))
    return p.parse_args(argv)


def session_and_batch(args: argparse.Namespace) -> tuple[Any, Any, list[Any]]:
    from rlctl.config.load import load_config
    from rlctl.contracts.types import RolloutRequest
    from rlctl.engine.batching import build_batch
    from rlctl.placement import place
    from rlctl.hooks.manager import load_plugins

    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        f"model.warm_start.steps={args.warm_start_steps}", "model.warm_start.target_dev_accuracy=null",
        f"algo.prompts_per_step={args.prompts}",
        f"algo.group_size={args.group}", f"algo.micro_batch_size={args.prompts * args.group}",
        f"rollout.max_tokens={args.max_tokens}", "train.optim.warmup_steps=0",
    ])
    s = place(cfg, load_plugins(), cache_root=Path(args.home).expanduser() / "cache").roles
    requests = [RolloutRequest(prompt_id=p.id, prompt_tokens=tuple(s.tokenizer(p.text)["input_ids"]),
                               group_size=args.group, sampling=s.sampling, dataset_version=s.task.version)
                for p in s.cursor.next(args.prompts)]
    trajectories = s.rollout.generate(requests)
    advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(len(trajectories))]
    return s, build_batch(trajectories, advantages, s.tokenizer.pad_token_id, s.sampling), trajectories


def minimal_step(model: Any, opt: Any, batch: Any, eps: float = 0.2) -> float:
    """A plain GRPO / PPO-clip step: what any implementation has to compute."""
    ids, attn = batch.input_ids, batch.attention_mask  # [N, T]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, :-1].float()  # [N, T-1, V]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [N, T-1]
    mask, adv, old = batch.action_mask[:, 1:], batch.advantages[:, 1:], batch.behavior_logprobs[:, 1:]
    ratio = torch.exp(logp - old)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    loss = (loss * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def shared_prompt_step(model: Any, opt: Any, trajectories: list[Any], group: int, pad_id: int,
                       eps: float = 0.2) -> float:
    """Estimate: each prompt forwarded once (with grad), its KV cache expanded to the G responses."""
    prompts = [t.prompt_tokens for t in trajectories[::group]]
    width = max(len(p) for p in prompts)
    p_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    p_mask = torch.zeros_like(p_ids)
    for i, p in enumerate(prompts):  # left-pad so every prompt ends at the same column
        p_ids[i, width - len(p):], p_mask[i, width - len(p):] = torch.tensor(p), 1
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True, logits_to_keep=1)
    kv = kv_cache_name()  # "cache", or "past_key_values" before transformers renamed it
    cache = getattr(out, kv)
    cache.batch_repeat_interleave(group)
    rlen = max(len(t.response_tokens) for t in trajectories)
    n = len(trajectories)
    r_ids = torch.full((n, rlen), pad_id, dtype=torch.long)
    r_mask = torch.zeros((n, rlen))
    old = torch.zeros((n, rlen))
    for i, t in enumerate(trajectories):
        r_ids[i, : len(t.response_tokens)] = torch.tensor(t.response_tokens)
        r_mask[i, : len(t.response_tokens)] = 1
        old[i, : len(t.behavior_logprobs)] = torch.tensor(t.behavior_logprobs)
    attn = torch.cat([p_mask.repeat_interleave(group, 0), torch.ones((n, rlen), dtype=torch.long)], dim=1)
    r_pos = p_pos[:, -1:].repeat_interleave(group, 0) + 1 + torch.arange(rlen)[None]
    r_out = model(input_ids=r_ids[:, :-1], attention_mask=attn[:, :-1], position_ids=r_pos[:, :-1], **{kv: cache})
    logits = torch.cat([out.logits[:, -1:].repeat_interleave(group, 0), r_out.logits], dim=1).float()  # [N, R, V]
    logp = torch.log_softmax(logits, -1).gather(-1, r_ids[..., None]).squeeze(-1)  # [N, R]
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(n)])[:, None]
    ratio = torch.exp(logp - old)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    loss = (loss * r_mask).sum() / r_mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def loop_stage(session: Any, scored: list[Any], group: int) -> None:
    """What the loop's T_l covers (rlctl.engine.loop.run_sync): group rewards, build_batch once, GRPO advantages
    broadcast onto each sequence's trained tokens, train_step."""
    from dataclasses import replace

    from rlctl.algo.advantages import grpo_advantages
    from rlctl.engine.batching import build_batch, group_rewards

    rewards, valid = group_rewards(scored, group)
    batch = build_batch(scored, [0.0] * len(scored), session.tokenizer.pad_token_id, session.sampling)
    advantages, _ = grpo_advantages(rewards, valid, normalize_std=True)
    batch = replace(batch, advantages=advantages.reshape(-1, 1).float() * (batch.action_mask > 0))
    session.learner.train_step(batch)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    session, batch, trajectories = session_and_batch(args)
    base = copy.deepcopy(session.learner.model.state_dict())

    def fresh() -> tuple[Any, Any]:
        model = copy.deepcopy(session.learner.model)
        model.load_state_dict(base)
        model.train()
        return model, torch.optim.AdamW(model.parameters(), lr=5e-5, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)

    scored = [t.updated(reward=float(i % 2)) for i, t in enumerate(trajectories)]
    m1, o1 = fresh()
    m2, o2 = fresh()
    cases: dict[str, Callable[[], Any]] = {
        "rlctl learner (train_step)": lambda: session.learner.train_step(batch),
        "rlctl loop learner stage (T_l)": lambda: loop_stage(session, scored, args.group),
        "minimal PyTorch GRPO step": lambda: minimal_step(m1, o1, batch),
        "minimal, prompt shared": lambda: shared_prompt_step(m2, o2, trajectories, args.group,
                                                                        session.tokenizer.pad_token_id),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = med["minimal PyTorch GRPO step"]
    n, width = batch.input_ids.shape
    real = int(batch.attention_mask.sum())
    print(f"\nlearner step, tiny model, batch {n} x {width} tokens ({real / (n * width):.0%} real), "
          f"median of {args.repeats} interleaved repeats, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(f"{'step':<36}{'time (s)':>10}{'vs minimal':>12}{'learned tok/s':>15}")
    learned = int(batch.action_mask.sum())
    for name, t in med.items():
        print(f"{name:<36}{t:>10.4f}{t / ref:>12.2f}{learned / t:>15.0f}")
    print(f"\noverhead of rlctl's learner machinery over the minimal step: "
          f"{(med['rlctl learner (train_step)'] / ref - 1) * 100:+.0f}%; loop stage: "
          f"{(med['rlctl loop learner stage (T_l)'] / ref - 1) * 100:+.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
