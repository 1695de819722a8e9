"""Cost of applying a weight update all-or-nothing on the rollout side, per training step (in-process path).

Run:  OMP_NUM_THREADS=1 python bench/weight_apply.py [--repeats 15] [--params 0]

What it measures (median of ``--repeats`` interleaved runs) for the
quickstart's built-in model (hidden 128, 4 layers, fp32) and, with
``--params N``, a Llama of about N parameters:

- ``copy``: one torch clone of every tensor (a memcpy of the weights): the
  floor any receiver that must not alias the sender's tensors pays;
- ``fingerprint``: rlctl.models.fingerprint over the state (what every
  receiver checks);
- ``before``: the previous LocalEngine.update_weights (clone + fingerprint +
  ``load_state_dict(strict=False)``, which copies a second time and could
  stop half way);
- ``all-or-nothing``: rlctl.engine.weight_apply.apply_update (check names,
  shapes, dtypes, tied pairs; stage one copy; fingerprint; swap the staged
  tensors in by reference).

Ratios are to ``before`` measured in the same run. Nothing is estimated.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import _setup  # noqa: F401  (one thread, offline, repo importable; imports torch)
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlctl.contracts.types import WeightUpdate
from rlctl.engine.weight_apply import apply_update
from rlctl.models.fingerprint import fingerprint


def _model(hidden: int, layers: int, heads: int, kv: int, mlp: int, vocab: int) -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _before(model: torch.nn.Module, update: WeightUpdate) -> None:
    current = model.state_dict()
    staged = {k: v.detach().to(current[k].dtype).clone() for k, v in update.state_dict.items() if k in current}
    assert fingerprint(staged) == update.fingerprint
    model.load_state_dict(staged, strict=False)


def _time(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run(name: str, model: torch.nn.Module, repeats: int) -> None:
    state = {k: v.detach().clone() + 0.001 for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    update = WeightUpdate(version=1, state_dict=state, fingerprint=fingerprint(state))
    params = sum(t.numel() for t in model.parameters())
    cases = {
        "copy": lambda: {k: v.clone() for k, v in state.items()},
        "fingerprint": lambda: fingerprint(state),
        "before": lambda: _before(model, update),
        "all-or-nothing": lambda: apply_update(model, update),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()  # warm up
    for _ in range(repeats):
        for key, fn in cases.items():
            times[key].append(_time(fn))
    base = statistics.median(times["before"])
    print(f"\n{name}: {params / 1e6:.2f}M parameters, {sum(t.numel() * t.element_size() for t in state.values()) / 2**20:.1f} MiB")
    print(f"{'step':<16}{'median ms':>12}{'vs before':>12}")
    for key in cases:
        med = statistics.median(times[key])
        print(f"{key:<16}{med * 1e3:>12.3f}{med / base:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--params", type=float, default=0, help="also a Llama of about this many parameters")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"load average {load:.1f}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    run("quickstart model", _model(128, 4, 4, 2, 384, 99), args.repeats)
    if args.params:
        hidden = 1024
        layers = max(1, int(args.params / (12 * hidden * hidden)))
        run(f"synthetic ~{args.params:.0e}", _model(hidden, layers, 16, 4, 4 * hidden, 32000), max(3, args.repeats // 3))


if __name__ == "__main__":
    main()
