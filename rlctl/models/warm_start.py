"""Supervised warm start of the built-in tiny model, cached by content.

What this is: a short SFT stage on the train split (loss on the answer's
policy-written tokens only: a tool-using demonstration's ``<out>...</out>`` is
the environment's and is masked) that gives the tiny model a starting policy
GRPO can improve, and the cache that makes it run once per (model shape,
warm-start settings including the stopping rule, dataset version, seed; and
the environment mask when demonstrations call tools). With ``target_dev_accuracy`` the
stage stops on a dev-split target instead of a step count: a fixed step count
lands at different accuracies on CPUs with different kernels, a target lands
every CPU at about the same starting policy. The cache entry is written
durably (temp dir, fsync, rename) with a ``COMPLETE`` marker inside, so a
killed warm start never leaves a half model; ``warm_start.json`` in it
records where the stage stopped and why.

What this is not: a general SFT trainer for large models.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from rlctl.config.models import ModelConfig
from rlctl.contracts.errors import ConfigError
from rlctl.contracts.types import PromptRecord, TaskData

# (step, total, loss) every step; a fourth argument, the dev accuracy, after each dev check
Progress = Callable[..., None]
INFO_FILE = "warm_start.json"
# What the environment writes in a demonstration: the tools environment's reply to a tool call. SFT must not train
# the policy to write it (in an episode those tokens come from the tool, and the policy's loss masks them).
ENV_SPAN = re.compile(r"<out>.*?</out>", re.DOTALL)


class WarmStartWarning(UserWarning):
    """The warm start hit its step cap before its dev-accuracy target (RL starts from a weaker policy)."""


@dataclass(frozen=True)
class SftResult:
    steps: int  # optimizer steps taken
    losses: list[float]
    dev_accuracy: float | None = None  # at the last dev check (None: no target, no checks)
    target: float | None = None
    reached: bool | None = None  # None when there was no target


def warm_start_seed(model: ModelConfig, seed: int) -> int:
    """The warm start's own seed: ``model.warm_start.seed`` when set, else the run's seed."""
    return model.warm_start.seed if model.warm_start.seed is not None else seed


def warm_start_key(model: ModelConfig, task: TaskData, seed: int) -> str:
    """Cache key over the model shape, every warm-start setting (stopping rule included), data and seed.

    Keyed on the records, not task.version: that also names the grader, which a warm start ignores; and on the
    rule that masks environment-written spans when the demonstrations have any."""
    dump = model.model_dump(mode="json")
    dump["warm_start"]["seed"] = warm_start_seed(model, seed)
    data = hashlib.sha256()
    for split in ("train", "dev", "hidden"):
        for r in task.split(split):
            data.update(f"{split}\x1f{r.id}\x1f{r.text}\x1f{r.sft_target}\x1e".encode())
    keyed = {"model": dump, "task": data.hexdigest(), "format": 2}
    if any(ENV_SPAN.search(r.sft_target) for r in task.train):  # what SFT masks; absent, old keys stay valid
        keyed["env_span"] = ENV_SPAN.pattern
    body = json.dumps(keyed, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def cap_message(result: SftResult, cap: int) -> str:
    return (f"the warm start stopped at its cap of {cap} steps with dev accuracy {result.dev_accuracy:.1%}, "
            f"below its target {result.target:.0%}: RL starts from a weaker policy than the config intends; "
            "raise model.warm_start.steps (or lower model.warm_start.target_dev_accuracy)")


def builtin_policy_dir(model: ModelConfig, task: TaskData, seed: int, cache_root: Path,
                       progress: Progress | None = None) -> Path:
    """Directory of the warm-started built-in model, building it on first use."""
    from rlctl.models.load import build_tiny
    from rlctl.models.tokenizer import build_char_tokenizer

    ws = model.warm_start
    if ws.enabled and ws.target_dev_accuracy and any(ENV_SPAN.search(r.sft_target) for r in task.train):
        raise ConfigError(
            "model.warm_start.target_dev_accuracy: the dev check decodes greedily without the environment, but "
            "these demonstrations call tools, so it would measure direct answers only and stop at the wrong point",
            "set model.warm_start.target_dev_accuracy: null and a fixed model.warm_start.steps "
            "(configs/quickstart-tools.yaml does)")
    target = cache_root / "warm_start" / warm_start_key(model, task, seed)
    if (target / "COMPLETE").is_file():
        _warn_if_capped(target, ws.steps)
        return target
    seed = warm_start_seed(model, seed)
    tokenizer = build_char_tokenizer()
    net = build_tiny(model, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id,
                     tokenizer.eos_token_id, seed)
    result = SftResult(steps=0, losses=[])
    if ws.enabled and ws.steps:
        result = sft(net, tokenizer, task.train, steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr, seed=seed,
                     progress=progress, dev=task.dev[:ws.eval_prompts] if ws.target_dev_accuracy else (),
                     target=ws.target_dev_accuracy, eval_every=ws.eval_every)
    from rlctl.storage.durable import write_dir_durably

    def fill(tmp: Path) -> None:
        net.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {k: v for k, v in asdict(result).items() if k != "losses"}
        info["final_loss"] = result.losses[-1] if result.losses else None
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        (tmp / "COMPLETE").write_text("ok\n")

    if not (target / "COMPLETE").is_file():  # another process may have built it meanwhile
        write_dir_durably(target, fill)
    _warn_if_capped(target, ws.steps)
    return target


def warm_start_info(policy_dir: Path) -> dict[str, Any] | None:
    """Where a cached warm start stopped (steps, dev accuracy, target), or None for other model dirs."""
    path = Path(policy_dir) / INFO_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _warn_if_capped(directory: Path, cap: int) -> None:
    info = warm_start_info(directory)
    if info and info.get("reached") is False:
        result = SftResult(steps=info["steps"], losses=[], dev_accuracy=info["dev_accuracy"], target=info["target"],
                           reached=False)
        warnings.warn(cap_message(result, cap), WarmStartWarning, stacklevel=2)


def sft(model: Any, tokenizer: Any, records: Sequence[PromptRecord], *, steps: int, batch_size: int,
        lr: float, seed: int, progress: Progress | None = None, dev: Sequence[PromptRecord] = (),
        target: float | None = None, eval_every: int = 100) -> SftResult:
    """Teacher-forced cross-entropy on ``prompt -> answer<eos>`` for at most ``steps`` steps.

    The loss covers the policy's tokens of the demonstration only: not the prompt
    and not what an environment writes (``demonstration_spans``).

    With ``target``, greedy exact-answer accuracy on ``dev`` is checked every
    ``eval_every`` steps (and at the cap); training stops at the first check
    that reaches it. The learning-rate schedule is always the one of ``steps``
    steps, so where it stops does not change what the steps before did.
    """
    import torch

    if target is not None and not dev:
        raise ValueError("a dev-accuracy target needs dev prompts")

    gen = torch.Generator().manual_seed(seed)
    encoded = [_encode(tokenizer, r) for r in records]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    losses: list[float] = []
    accuracy = None
    for step in range(steps):
        idx = torch.randint(len(encoded), (batch_size,), generator=gen).tolist()
        parts = [_pad(rows, tokenizer.pad_token_id) for rows in _split_by_length([encoded[i] for i in idx])]
        if len(parts) == 1:
            loss = sft_loss(model, *parts[0])
        else:  # the same token mean as one padded batch, computed on two less padded ones
            counts = [int((labels[:, 1:] != -100).sum()) for _, labels, _ in parts]
            loss = sum(sft_loss(model, *part) * n for part, n in zip(parts, counts)) / sum(counts)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, steps, losses[-1])
        if target is not None and ((step + 1) % eval_every == 0 or step + 1 == steps):
            accuracy = greedy_accuracy(model, tokenizer, dev)
            model.train()
            if progress is not None:
                progress(step + 1, steps, losses[-1], accuracy)
            if accuracy >= target:
                break
    model.eval()
    reached = None if target is None else accuracy is not None and accuracy >= target
    return SftResult(steps=len(losses), losses=losses, dev_accuracy=accuracy, target=target, reached=reached)


def sft_loss(model: Any, ids: Any, labels: Any, mask: Any) -> Any:
    """Mean next-token cross-entropy over the positions whose label is not -100 (the policy's tokens)."""
    import torch

    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()  # [B, T-1, V]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)


def greedy_accuracy(model: Any, tokenizer: Any, records: Sequence[PromptRecord], batch_size: int = 512) -> float:
    """Share of ``records`` whose greedy answer (up to eos) equals the reference answer exactly."""
    import torch

    model.eval()
    longest = max(len(tokenizer(r.answer, add_special_tokens=False)["input_ids"]) for r in records)
    correct = 0
    with torch.no_grad():
        for start in range(0, len(records), batch_size):
            chunk = records[start:start + batch_size]
            rows = [tokenizer(r.text)["input_ids"] for r in chunk]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, row in enumerate(rows):  # left padding: every row's next token is at the end
                ids[i, width - len(row):] = torch.tensor(row)
                mask[i, width - len(row):] = 1
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest + 1, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
            correct += sum(text.strip() == r.answer for text, r in zip(texts, chunk))
    return correct / len(records)


def demonstration_spans(text: str) -> list[tuple[str, bool]]:
    """``text`` cut into (piece, written by the policy) in order: ``<out>...</out>`` spans are the environment's."""
    spans: list[tuple[str, bool]] = []
    at = 0
    for match in ENV_SPAN.finditer(text):
        spans += [(text[at:match.start()], True), (match.group(), False)]
        at = match.end()
    spans.append((text[at:], True))
    return [(piece, policy) for piece, policy in spans if piece]


def _encode(tokenizer: Any, record: PromptRecord) -> tuple[list[int], list[bool]]:
    """Token ids of ``prompt + demonstration + eos`` and, per id, whether SFT trains on it (policy-written only).

    Each span is tokenized on its own, as an episode's ids are: the environment's
    observation is appended to the policy's ids, never re-tokenized with them."""
    ids = tokenizer(record.text)["input_ids"]
    trained = [False] * len(ids)
    for piece, policy in demonstration_spans(record.sft_target):
        piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
        ids, trained = ids + piece_ids, trained + [policy] * len(piece_ids)
    return ids + [tokenizer.eos_token_id], trained + [True]


def _split_by_length(rows: list[tuple[list[int], list[bool]]]) -> list[list[tuple[list[int], list[bool]]]]:
    """The batch as one block, or as (short rows, long rows) when two blocks pad at most half as many tokens.

    A few long tool-using demonstrations among short direct answers would
    otherwise pad every row to their length."""
    lengths = sorted(len(ids) for ids, _ in rows)
    whole = len(rows) * lengths[-1]
    best, cut = min((k * lengths[k - 1] + (len(rows) - k) * lengths[-1], lengths[k - 1])
                    for k in range(1, len(rows) + 1))
    if best > whole / 2:
        return [rows]
    return [[r for r in rows if len(r[0]) <= cut], [r for r in rows if len(r[0]) > cut]]


def _pad(rows: list[tuple[list[int], list[bool]]], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (seq, trained) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq)] = torch.tensor([t if keep else -100 for t, keep in zip(seq, trained)])
        mask[i, : len(seq)] = 1
    return ids, labels, mask
