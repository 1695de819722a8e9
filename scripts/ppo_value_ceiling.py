"""How much of the reward variance can ANY critic explain on the quickstart task? Explained variance of the exact
value function next to a trained critic's, per response position.

On the arithmetic task the answer is known, so the policy's true value of a response prefix (of the math reward)
is exact: 0 once the prefix has left the correct answer, else the probability that the policy completes it
correctly, the product of its token probabilities along the correct continuation (one forward pass over prompt +
answer + eos). With the ``digit_credit`` reward in the config (configs/quickstart-ppo-credit.yaml) the graded
reward is that one: credit m / n for the m leading tokens of answer + eos written right (n of them, one character
a token), so a prefix that left the answer after m tokens is worth m / n, and one still on it after k tokens is
worth (k + E_k) / n with E_k = p_k (1 + E_k+1) the expected number of further right tokens. This script samples batches from a policy (the quickstart's cached warm start unless
``--policy DIR``) at the rollout temperature, and prints, over the response tokens and per position:

- ``exact``: explained variance of that true value against the sampled math reward (the ceiling of any critic
  that sees only the prefix; noise in the reward itself is what it cannot explain), and
- ``critic``: the same for the configured critic (algo.critic) after ``--critic-steps`` steps of its own
  train_step on fresh batches (critic only, the policy fixed; returns = the sampled reward, gamma = lambda = 1).

    OMP_NUM_THREADS=1 python scripts/ppo_value_ceiling.py --batches 8 --critic-steps 60
    OMP_NUM_THREADS=1 python scripts/ppo_value_ceiling.py --critic-steps 200 --head-only algo.critic.lr=1e-2
    OMP_NUM_THREADS=1 python scripts/ppo_value_ceiling.py --critic-steps 60 --targets exact
    OMP_NUM_THREADS=1 python scripts/ppo_value_ceiling.py --critic-steps 0 --probe-batches 40

Variants of the critic's training (each a question about the critic, not a change to rlctl's critic):

- ``--head-only``: only the scalar head trains (the policy's backbone frozen), at ``algo.critic.lr`` (a linear
  probe of the policy's own features, trained by the critic's loss);
- ``--targets exact``: the critic regresses onto the exact per-token values instead of the sampled reward (an
  oracle, noise-free target: can the value model represent V at all from this many samples?);
- ``--probe-batches N``: also a least-squares linear probe (ridge 1e-3) of the frozen backbone's features onto
  the sampled reward, fitted on N fresh batches: the best any head-only critic of these features can do
  (column ``probe``).

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
    parser.add_argument("--head-only", action="store_true", help="Train only the value head (backbone frozen).")
    parser.add_argument("--targets", choices=("reward", "exact"), default="reward",
                        help="Critic targets: the sampled reward (as in training) or the exact values (oracle).")
    parser.add_argument("--probe-batches", type=int, default=0, help="Fit a linear probe on N batches (0: off).")
    parser.add_argument("--seed", type=int, default=0, help="torch seed (sampling, prompt order).")
    parser.add_argument("extra", nargs="*", help="Overrides, e.g. algo.critic.lr=3e-3.")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    import torch

    from rlctl.algo.losses import explained_variance
    from rlctl.cli._options import rlctl_home
    from rlctl.config.load import load_config
    from rlctl.engine.batching import build_batch
    from rlctl.engine.groups import Sampler, request_encoder, sample_groups
    from rlctl.placement import place
    from rlctl.hooks.manager import load_plugins

    torch.manual_seed(args.seed)
    overrides = ["algo.name=ppo", *([f"model.path={args.policy}"] if args.policy else []), *args.extra]
    config = load_config(args.config, overrides)
    s = place(config, load_plugins(), cache_root=rlctl_home() / "cache").roles
    answers = {r.id: r.answer for r in s.task.train}
    a = config.algo
    sampler = Sampler(prompts=s.cursor.next, make_request=request_encoder(s, a.group_size), rollout=s.rollout,
                      reward=s.reward, answers=answers, estimator=s.estimator, group_size=a.group_size,
                      max_tokens=config.rollout.max_tokens, truncation_penalty=0.0)

    def sample():
        scored = sample_groups(sampler, a.prompts_per_step).selection.kept
        batch = build_batch(scored, [0.0] * len(scored), s.tokenizer.pad_token_id, s.sampling)
        return scored, batch

    model = s.learner.model.eval()

    graded = "digit_credit" if any(c.name == "digit_credit" for c in config.reward.components) else "math"

    def exact_values(scored, batch):
        """[N, T]: the policy's expected graded reward from each response prefix on (math: the probability of finishing
        it correctly, 0 once off the answer; digit_credit: the credit already earned plus the expected rest)."""
        mask = batch.action_mask > 0
        v_exact = torch.zeros(mask.shape)
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
            p, more = step.exp().tolist(), [0.0] * (len(target) + 1)  # more[k]: expected right tokens from k on
            for k in reversed(range(len(target))):
                more[k] = p[k] * (1.0 + more[k + 1])
            response = list(t.response_tokens)
            right = next((j for j, (x, y) in enumerate(zip(response, target)) if x != y), min(len(response),
                                                                                             len(target)))
            cols = mask[i].nonzero().flatten().tolist()
            for k, col in enumerate(cols):
                on_path = k < len(target) and response[:k] == target[:k]
                if graded == "math":
                    v_exact[i, col] = float(suffix[k]) if on_path else 0.0
                else:
                    v_exact[i, col] = (k + more[k] if on_path else right) / len(target)
        return v_exact

    value_model = s.critic.model
    if args.head_only:  # the backbone stays the policy's; only the head's weight and bias learn
        for p in value_model.backbone.parameters():
            p.requires_grad_(False)
        s.critic.optimizer = torch.optim.AdamW(value_model.head.parameters(), lr=config.algo.critic.lr,
                                               weight_decay=config.train.optim.weight_decay)
    for _ in range(args.critic_steps):  # the critic learns on its own batches, as in critic warm-up steps
        scored, batch = sample()
        if args.targets == "exact":  # oracle targets: the math reward's exact value + the (near-constant) format
            fmt = torch.tensor([float(t.reward) - t.reward_components.get(graded, 0.0) for t in scored]).view(-1, 1)
            targets = exact_values(scored, batch) + fmt * (batch.action_mask > 0)
        else:
            targets = torch.tensor([float(t.reward) for t in scored]).view(-1, 1) * (batch.action_mask > 0)  # [N, T]
        s.critic.train_step(batch, targets, s.critic.values(batch))

    def features(batch):
        """[N, T, H]: the frozen value model's backbone state each token's value is read from."""
        with torch.no_grad():
            ids, am = batch.input_ids, batch.attention_mask
            hidden = value_model.backbone(input_ids=ids, attention_mask=am,
                                          position_ids=(am.cumsum(-1) - 1).clamp(min=0)).last_hidden_state
        return torch.nn.functional.pad(hidden[:, :-1], (0, 0, 1, 0)).float()

    probe = None
    if args.probe_batches:  # ridge regression of the graded reward on [features, 1] over response tokens
        xs, ys = [], []
        for _ in range(args.probe_batches):
            scored, batch = sample()
            m = batch.action_mask > 0
            r = torch.tensor([t.reward_components.get(graded, 0.0) for t in scored]).view(-1, 1).expand_as(m)
            f = features(batch)[m]
            xs.append(torch.cat([f, torch.ones(len(f), 1)], -1).double())
            ys.append(r[m].double())
        x, y = torch.cat(xs), torch.cat(ys)
        probe = torch.linalg.solve(x.T @ x + 1e-3 * torch.eye(x.shape[1], dtype=x.dtype), x.T @ y).float()
        print(f"probe fitted on {len(y)} response tokens ({args.probe_batches} batches)")

    math_r, exact, critic, probed, masks = [], [], [], [], []
    for _ in range(args.batches):
        scored, batch = sample()
        mask = batch.action_mask > 0  # [N, T]
        math_r.append(torch.tensor([t.reward_components.get(graded, 0.0) for t in scored]).view(-1, 1) * mask)
        exact.append(exact_values(scored, batch))
        critic.append(s.critic.values(batch))
        if probe is not None:
            f = features(batch)
            probed.append((torch.cat([f, torch.ones(*f.shape[:2], 1)], -1) @ probe) * mask)
        masks.append(mask)
    width = max(m.shape[1] for m in masks)

    def cat(xs):
        return torch.cat([torch.nn.functional.pad(x.float(), (width - x.shape[1], 0)) for x in xs])

    r, ve, vc, m = cat(math_r), cat(exact), cat(critic), cat(masks)
    vp = cat(probed) if probed else None
    position = m.long().cumsum(-1) * m.long()  # 1-based position in the response
    print(f"{'tokens':<14}{'n':>6}{'exact value EV':>16}{'critic EV':>11}{'probe EV':>10}"
          f"   ({graded} reward mean {float(r[m > 0].mean()):.3f})")
    rows = [("all", m)] + [(f"position {k}", position == k) for k in range(1, int(position.max()) + 1)]
    for name, sel in rows:
        if int(sel.sum()) < 20:
            continue
        probe_ev = f"{explained_variance(vp, r, sel):>10.3f}" if vp is not None else f"{'-':>10}"
        print(f"{name:<14}{int(sel.sum()):>6}{explained_variance(ve, r, sel):>16.3f}"
              f"{explained_variance(vc, r, sel):>11.3f}{probe_ev}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
