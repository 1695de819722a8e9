"""How much of the reward variance can ANY critic explain on the quickstart task? Explained variance of the exact
value function next to a trained critic's, per response position.

On the arithmetic task the answer is known, so the policy's true value of a response prefix (of the math reward)
is exact: 0 once the prefix has left the correct answer, else the probability that the policy completes it
correctly, the product of its token probabilities along the correct continuation (one forward pass over prompt +
answer + eos). This script samples batches from a policy (the quickstart's cached warm start unless
``--policy DIR``) at the rollout temperature, and prints, over the response tokens and per position:

- ``exact``: explained variance of that true value against the sampled math reward (the ceiling of any critic
  that sees only the prefix; noise in the reward itself is what it cannot explain), and
- ``critic``: the same for the configured critic (algo.critic) after ``--critic-steps`` steps of its own
  train_step on fresh batches (critic only, the policy fixed; returns = the sampled reward, gamma = lambda = 1).

    OMP_NUM_THREADS=1 python scripts/ppo_value_ceiling.py --batches 8 --critic-steps 60

The format reward (0.1, almost always earned) is left out: it is a near-constant the critic's bias absorbs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"))
    parser.add_argument("--batches", type=int, default=8, help="Held-out batches the variances are measured on.")
    parser.add_argument("--critic-steps", type=int, default=60, help="Critic train steps before it is measured.")
    parser.add_argument("--policy", default=None, help="Policy directory (default: the config's warm start).")
    parser.add_argument("extra", nargs="*", help="Overrides, e.g. algo.critic.lr=3e-3.")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    import torch

    from rlctl.algo.losses import explained_variance
    from rlctl.cli._options import rlctl_home
    from rlctl.config.load import load_config
    from rlctl.contracts.types import RolloutRequest
    from rlctl.engine.batching import build_batch
    from rlctl.engine.estimation import sample_groups
    from rlctl.engine.session import build_session
    from rlctl.hooks.manager import load_plugins

    overrides = ["algo.name=ppo", *([f"model.path={args.policy}"] if args.policy else []), *args.extra]
    config = load_config(args.config, overrides)
    s = build_session(config, load_plugins(), rlctl_home() / "cache")
    answers = {r.id: r.answer for r in s.task.train}
    a = config.algo

    def request(p):
        return RolloutRequest(prompt_id=p.id, prompt_tokens=tuple(s.tokenizer(p.text)["input_ids"]),
                              group_size=a.group_size, sampling=s.sampling, dataset_version=s.task.version)

    def sample():
        out = sample_groups(prompts=s.cursor.next, make_request=request, rollout=s.rollout, reward=s.reward,
                            answers=answers, estimator=s.estimator, num_prompts=a.prompts_per_step,
                            group_size=a.group_size, max_tokens=config.rollout.max_tokens, truncation_penalty=0.0)
        batch = build_batch(out.scored, [0.0] * len(out.scored), s.tokenizer.pad_token_id, s.sampling)
        return out.scored, batch

    for _ in range(args.critic_steps):  # the critic learns on its own batches, as in critic warm-up steps
        scored, batch = sample()
        reward = torch.tensor([float(t.reward) for t in scored]).view(-1, 1) * (batch.action_mask > 0)  # [N, T]
        s.critic.train_step(batch, reward, s.critic.values(batch))

    model = s.learner.model.eval()
    math_r, exact, critic, masks = [], [], [], []
    for _ in range(args.batches):
        scored, batch = sample()
        mask = batch.action_mask > 0  # [N, T]
        r = torch.tensor([t.reward_components.get("math", 0.0) for t in scored]).view(-1, 1) * mask
        v_exact = torch.zeros_like(r)
        for i, t in enumerate(scored):
            target = list(s.tokenizer(answers[t.prompt_id], add_special_tokens=False)["input_ids"])
            target.append(s.tokenizer.eos_token_id)
            ids = torch.tensor([list(t.prompt_tokens) + target])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float() / (s.sampling.temperature or 1.0),
                                         -1)
            n = len(t.prompt_tokens)
            step = logp[n - 1:n - 1 + len(target)].gather(-1, torch.tensor(target).view(-1, 1)).squeeze(-1)
            suffix = torch.flip(torch.cumsum(torch.flip(step, [0]), 0), [0]).exp()  # P(correct from position k)
            response = list(t.response_tokens)
            cols = mask[i].nonzero().flatten().tolist()
            for k, col in enumerate(cols):
                on_path = k < len(target) and response[:k] == target[:k]
                v_exact[i, col] = float(suffix[k]) if on_path else 0.0
        math_r.append(r)
        exact.append(v_exact)
        critic.append(s.critic.values(batch))
        masks.append(mask)
    width = max(m.shape[1] for m in masks)

    def cat(xs):
        return torch.cat([torch.nn.functional.pad(x.float(), (width - x.shape[1], 0)) for x in xs])

    r, ve, vc, m = cat(math_r), cat(exact), cat(critic), cat(masks)
    position = m.long().cumsum(-1) * m.long()  # 1-based position in the response
    print(f"{'tokens':<14}{'n':>6}{'exact value EV':>16}{'critic EV':>11}   (math reward mean {float(r[m > 0].mean()):.3f})")
    rows = [("all", m)] + [(f"position {k}", position == k) for k in range(1, int(position.max()) + 1)]
    for name, sel in rows:
        if int(sel.sum()) < 20:
            continue
        print(f"{name:<14}{int(sel.sum()):>6}{explained_variance(ve, r, sel):>16.3f}"
              f"{explained_variance(vc, r, sel):>11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
