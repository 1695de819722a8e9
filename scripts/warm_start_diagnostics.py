"""Why RL gains (or not) from a warm start: its greedy and sampled answers on the DEV split.

    OMP_NUM_THREADS=1 python scripts/warm_start_diagnostics.py $RLCTL_HOME/cache/warm_start/<key> --temps 1.0,0.7

Prints, for the policy directory given: greedy pass@1 and how the wrong greedy answers are wrong
(off by 1-2, i.e. the units digit; other; malformed; ...) with the signed differences; then per
temperature, with ``--group-size`` samples per prompt like a GRPO group: the sampled accuracy,
pass@G, and the fraction of groups without reward variance (``frac_zero_std``: all right or all
wrong, so no GRPO signal). Dev only; the hidden split is for final numbers.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def kind(pred: str, answer: str) -> str:
    if pred == answer:
        return "ok"
    try:
        got = int(pred)
    except ValueError:
        return "malformed"
    want = int(answer)
    if got == -want:
        return "sign"
    if abs(got - want) in (1, 2):
        return "off-by-1-2"
    if len(pred.lstrip("-")) != len(answer.lstrip("-")):
        return "length"
    return "other"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("policy", help="A policy directory (e.g. a cached warm start).")
    parser.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"))
    parser.add_argument("--prompts", type=int, default=496, help="First N dev prompts.")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--temps", default="1.0", help="Comma-separated sampling temperatures.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from rlctl.config.load import load_config
    from rlctl.placement.build import load_task
    from rlctl.hooks.manager import load_plugins
    from rlctl.models.load import load_policy

    config = load_config(args.config, [])
    dev = load_task(config, load_plugins()).dev[:args.prompts]
    model, tok = load_policy(args.policy)
    model.eval()
    torch.manual_seed(args.seed)

    def answers(sample: bool, temperature: float = 1.0, n: int = 1) -> list[str]:
        rows = [tok(r.text)["input_ids"] for r in dev]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):  # left padding
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
        how = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=config.rollout.max_tokens,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **how)
        return [t.strip() for t in tok.batch_decode(out[:, width:], skip_special_tokens=True)]

    greedy = answers(False)
    kinds = collections.Counter(kind(g, r.answer) for g, r in zip(greedy, dev))
    diffs: collections.Counter = collections.Counter()
    for g, r in zip(greedy, dev):
        if kind(g, r.answer) not in ("ok", "malformed"):
            diffs[int(g) - int(r.answer)] += 1
    print(f"{args.policy}: {len(dev)} dev prompts")
    print(f"greedy pass@1 {kinds['ok'] / len(dev):.1%}; wrong answers by kind {dict(kinds)}")
    print(f"greedy minus reference, wrong answers: {sorted(diffs.items(), key=lambda kv: -kv[1])[:8]}")
    g = args.group_size
    for temperature in [float(t) for t in args.temps.split(",")]:
        sampled = answers(True, temperature, g)
        right = [[x == r.answer for x in sampled[i * g:(i + 1) * g]] for i, r in enumerate(dev)]
        flat = [x for group in right for x in group]
        all_wrong = sum(not any(group) for group in right)
        all_right = sum(all(group) for group in right)
        print(f"T={temperature}: sampled accuracy {sum(flat) / len(flat):.1%}, pass@{g} "
              f"{1 - all_wrong / len(dev):.1%}, frac_zero_std {(all_wrong + all_right) / len(dev):.1%} "
              f"(all wrong {all_wrong}, all right {all_right})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
