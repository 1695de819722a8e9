"""Supervised warm start of the built-in tiny model, cached by content.

What this is: a short SFT stage on the train split (loss on answer tokens
only) that gives the tiny model a starting policy GRPO can improve, and the
cache that makes it run once per (model shape, warm-start settings, dataset
version, seed). The cache entry is written durably (temp dir, fsync, rename) with a
``COMPLETE`` marker inside, so a killed warm start never leaves a half model.

What this is not: a general SFT trainer for large models.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from rlctl.config.models import ModelConfig
from rlctl.contracts.types import PromptRecord, TaskData

Progress = Callable[[int, int, float], None]  # (step, total, loss)


def warm_start_key(model: ModelConfig, task: TaskData, seed: int) -> str:
    # Keyed on the records, not task.version: that also names the grader, which a warm start ignores.
    data = hashlib.sha256()
    for split in ("train", "dev", "hidden"):
        for r in task.split(split):
            data.update(f"{split}\x1f{r.id}\x1f{r.text}\x1f{r.sft_target}\x1e".encode())
    body = json.dumps({"model": model.model_dump(mode="json"), "task": data.hexdigest(), "seed": seed,
                       "format": 1}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def builtin_policy_dir(model: ModelConfig, task: TaskData, seed: int, cache_root: Path,
                       progress: Progress | None = None) -> Path:
    """Directory of the warm-started built-in model, building it on first use."""
    from rlctl.models.load import build_tiny
    from rlctl.models.tokenizer import build_char_tokenizer

    target = cache_root / "warm_start" / warm_start_key(model, task, seed)
    if (target / "COMPLETE").is_file():
        return target
    tokenizer = build_char_tokenizer()
    net = build_tiny(model, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id,
                     tokenizer.eos_token_id, seed)
    if model.warm_start.enabled and model.warm_start.steps:
        sft(net, tokenizer, task.train, steps=model.warm_start.steps, batch_size=model.warm_start.batch_size,
            lr=model.warm_start.lr, seed=seed, progress=progress)
    from rlctl.engine.durable import write_dir_durably

    def fill(tmp: Path) -> None:
        net.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "COMPLETE").write_text("ok\n")

    if not (target / "COMPLETE").is_file():  # another process may have built it meanwhile
        write_dir_durably(target, fill)
    return target


def sft(model: Any, tokenizer: Any, records: Sequence[PromptRecord], *, steps: int, batch_size: int,
        lr: float, seed: int, progress: Progress | None = None) -> list[float]:
    """Teacher-forced cross-entropy on ``prompt -> answer<eos>``; returns the loss per step."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    encoded = [_encode(tokenizer, r) for r in records]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    losses = []
    for step in range(steps):
        idx = torch.randint(len(encoded), (batch_size,), generator=gen).tolist()
        ids, labels, mask = _pad([encoded[i] for i in idx], tokenizer.pad_token_id)
        out = model(input_ids=ids, attention_mask=mask)
        logits = out.logits[:, :-1].float()  # [B, T-1, V]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, steps, losses[-1])
    model.eval()
    return losses


def _encode(tokenizer: Any, record: PromptRecord) -> tuple[list[int], int]:
    prompt = tokenizer(record.text)["input_ids"]
    answer = tokenizer(record.sft_target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + answer, len(prompt)


def _pad(rows: list[tuple[list[int], int]], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (seq, n_prompt) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, n_prompt: len(seq)] = torch.tensor(seq[n_prompt:])
        mask[i, : len(seq)] = 1
    return ids, labels, mask
