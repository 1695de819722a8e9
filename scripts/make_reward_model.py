"""Write a tiny reward model (Llama sequence classifier, one scalar output, character tokenizer), locally.

    OMP_NUM_THREADS=1 python scripts/make_reward_model.py /tmp/rm               # random weights (seeded)
    OMP_NUM_THREADS=1 python scripts/make_reward_model.py /tmp/rm --fit-steps 200  # prefers right sums of a+b=

Then serve it: ``rlctl serve reward --model /tmp/rm --port 30100``, and score with
``reward.components: [{name: reward_model, options: {servers: [http://127.0.0.1:30100]}}]``.
Nothing is downloaded (rlctl.models.reward_model).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="Directory to write (created).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fit-steps", type=int, default=0, help="Bradley-Terry steps on a+b= pairs (0: random weights).")
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlctl.models.reward_model import build_tiny_reward_model, pairwise_accuracy

    path = build_tiny_reward_model(args.out, seed=args.seed, fit_steps=args.fit_steps,
                                   hidden_size=args.hidden_size, num_layers=args.layers)
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).eval()
    accuracy = pairwise_accuracy(model, AutoTokenizer.from_pretrained(path, local_files_only=True))
    print(f"wrote {path}: LlamaForSequenceClassification, num_labels=1; right sum above a wrong one in "
          f"{accuracy:.1%} of 200 held-out a+b= pairs (chance: 50%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
