"""A tiny reward model built locally from a config: for tests, demos and ``rlctl serve reward`` smoke runs.

What this is: ``build_tiny_reward_model(out)`` writes a Hugging Face
``LlamaForSequenceClassification`` (``num_labels=1``: one scalar score per
sequence) with rlctl's character tokenizer. Nothing is downloaded. With
``fit_steps`` it is briefly fitted (Bradley-Terry on pairs) to prefer
``a+b=`` followed by the right sum over a wrong one -- a weak signal at this
size (``scripts/make_reward_model.py --fit-steps 200`` prints its held-out
pairwise accuracy); with 0 the weights are random (seeded).

What this is not: a trained preference model. Real runs serve their own
(``rlctl serve reward --model DIR``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any


def tiny_reward_config(tokenizer: Any, *, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 2,
                       intermediate_size: int = 64, max_positions: int = 256) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                       max_position_embeddings=max_positions, num_labels=1, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       architectures=["LlamaForSequenceClassification"])


def build_tiny_reward_model(out: str | Path, *, seed: int = 0, fit_steps: int = 0, **config: Any) -> Path:
    """Write a tiny scalar-head reward model into ``out`` (created); returns the directory."""
    import torch
    from transformers import LlamaForSequenceClassification

    from rlctl.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(tiny_reward_config(tokenizer, **config))
        if fit_steps:
            fit_arithmetic_preference(model, tokenizer, steps=fit_steps, seed=seed)
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def fit_arithmetic_preference(model: Any, tokenizer: Any, *, steps: int, seed: int = 0, batch_size: int = 32,
                              lr: float = 3e-3) -> list[float]:
    """Bradley-Terry: score(``a+b=`` + right sum) above score(same prompt + a wrong sum); returns the losses."""
    import torch

    rng = random.Random(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    pad = tokenizer.pad_token_id
    model.train()
    losses = []
    for _ in range(steps):
        good, bad = [], []
        for _ in range(batch_size):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
            good.append(f"{a}+{b}={a + b}")
            bad.append(f"{a}+{b}={wrong}")
        ids = [tokenizer(t)["input_ids"] for t in good + bad]
        width = max(map(len, ids))
        batch = torch.tensor([row + [pad] * (width - len(row)) for row in ids])
        mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r in ids])[:, None]).long()
        scores = model(input_ids=batch, attention_mask=mask).logits[:, 0]
        loss = -torch.nn.functional.logsigmoid(scores[:batch_size] - scores[batch_size:]).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def pairwise_accuracy(model: Any, tokenizer: Any, pairs: int = 200, seed: int = 1) -> float:
    """Share of held-out ``a+b=`` pairs where the right sum scores above a wrong one (0.5 = chance)."""
    import torch

    rng = random.Random(seed)
    wins = 0
    with torch.inference_mode():
        for _ in range(pairs):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            wrong = a + b + rng.choice([-2, -1, 1, 2])
            good, bad = (model(**tokenizer(f"{a}+{b}={v}", return_tensors="pt")).logits[0, 0] for v in (a + b, wrong))
            wins += int(good > bad)
    return wins / pairs
