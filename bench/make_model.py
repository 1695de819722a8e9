"""Build a second model shape for bench/grpo_vs_trl.py: a ~1M-parameter Qwen2 and its task files, locally.

Run:  python bench/make_model.py DIR [--task-out TASKDIR] [--sft-steps 300]

Writes a Hugging Face model directory DIR: Qwen2 architecture (q/k/v biases), hidden 128, 4 layers, 4 heads
and 4 KV heads (no GQA), MLP 512, with rlctl's character tokenizer (1.07M parameters), briefly warm-started by
SFT on the task's train split (``--sft-steps``, 0 = random weights). With ``--task-out`` it also writes the
task as train/dev/hidden JSONL files (``{"prompt", "answer"}``) for ``grpo_vs_trl.py --task``: ``a op b`` with
op in ``+-*`` and operands 0-99, drawn by rlctl's arith task source. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402,F401  (one thread, offline; must precede torch)

import torch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="Model directory to write.")
    p.add_argument("--task-out", help="Also write the task's train/dev/hidden JSONL files here.")
    p.add_argument("--sft-steps", type=int, default=300, help="Warm-start SFT steps (0 = random weights).")
    p.add_argument("--num-train", type=int, default=14000, help="Distinct train prompts.")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlctl.hooks.manager import load_plugins
    from rlctl.models.tokenizer import build_char_tokenizer
    from rlctl.models.warm_start import sft

    args = parse_args(argv)
    task = load_plugins().build("task_source", "arith", {
        "num_terms": 2, "max_operand": 99, "ops": "+-*", "num_train": args.num_train, "num_dev": 300,
        "num_hidden": 500}, "task.options", seed=args.seed).load()
    if args.task_out:
        out = Path(args.task_out)
        out.mkdir(parents=True, exist_ok=True)
        for split in ("train", "dev", "hidden"):
            rows = [json.dumps({"prompt": r.text, "answer": r.answer}) for r in task.split(split)]
            (out / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=True)
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(cfg)
    if args.sft_steps:
        losses = sft(model, tok, task.train, steps=args.sft_steps, batch_size=64, lr=3e-3, seed=args.seed).losses
        print(f"SFT {args.sft_steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"wrote {args.out}: Qwen2, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
