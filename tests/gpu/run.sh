#!/usr/bin/env bash
# GPU checks (never in CI: no GPU there). Needs one CUDA GPU and the project's venv with the bench and ray extras
# (pip install -e '.[dev,bench,ray]'); downloads nothing: every model is built from a config with random weights.
# Budget: at most 8 minutes on one GPU (an estimate: this script has not been run on a GPU yet, see docs/gpus.md).
#   1. pytest -m gpu tests/gpu: cuda placement and fp32 reconciliation, bf16 on GPU with fp32 optimizer state
#      and the bf16 reconciliation, FSDP2 with NCCL on one GPU (train, sharded checkpoint, reload, export),
#      an FSDP2 rank as a Ray actor on its own GPU, a colocated local engine (fractional KV budget, weights
#      offloaded between calls, same greedy rollouts);
#   2. the quickstart on cuda (one seed, 3 steps of its config so the check stays short), printing its summary;
#   3. a ~0.5B Qwen2-shaped model (Qwen2-0.5B's layout and vocabulary, 494M parameters, random weights):
#      5 GRPO steps with the fsdp2 learner on one GPU (world_size 1, bf16 + fp32 master shards), printing the
#      step time, the peak of torch.cuda.max_memory_allocated, and the dry-run ledger per role next to the
#      allocator's peak in that role's phase, with the ratio (bench/fsdp_ledger.py);
#   4. rlctl's GRPO step time vs TRL's GRPOTrainer on the same 0.5B model and settings (B, G, max tokens,
#      bf16), interleaved in one process, ratio printed (bench/trl_step_time.py).
# Each step has its own timeout (150 + 120 + 100 + 110 s = 8 min at most); outputs land in $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export RLCTL_HOME=${RLCTL_HOME:-$PWD/.rlctl-gpu}
OUT=${OUT:-$PWD/.gpu-run}
mkdir -p "$OUT"

"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "tests/gpu/run.sh needs a CUDA device (torch.cuda.is_available() is False)"
print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY

timeout 150 "$PY" -m pytest tests/gpu -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt"

start=$(date +%s)
timeout 120 "$PY" -m rlctl.cli.app train configs/quickstart.yaml train.device=cuda rollout.options.device=cuda train.seeds=1 \
    train.steps=3 --run-dir "$OUT/quickstart" --json > "$OUT/quickstart.json"
echo "quickstart on cuda (3 steps): $(( $(date +%s) - start )) s wall; summary in $OUT/quickstart.json"
"$PY" - "$OUT/quickstart.json" <<'PY'
import json, sys
out = json.load(open(sys.argv[1]))
metrics = out.get("last_metrics") or {}
print("status:", out["run"]["status"], "| wall_s:", out.get("wall_s"), "| last metrics:",
      {k: v for k, v in metrics.items() if k in ("reward_mean", "loss", "step_time_s")})
PY

# 3. ~0.5B Qwen2, fsdp2 on one GPU: step time, peak memory, ledger vs torch.cuda.max_memory_allocated per role
MODELS=${MODELS:-${TMPDIR:-/tmp}/rlctl-gpu-models}  # ~2 GB of fp32 weights: kept out of $OUT
SHAPE=(--shape qwen2-0.5b --vocab qwen --prompts 8 --group 4 --max-tokens 64 --models "$MODELS")
timeout 100 "$PY" bench/fsdp_ledger.py --device cuda "${SHAPE[@]}" --steps 5 --micro-batch 8 2>&1 \
    | tee "$OUT/fsdp_ledger.txt"

# 4. rlctl vs TRL GRPOTrainer step time on the same model and settings (the model directory from step 3)
timeout 110 "$PY" bench/trl_step_time.py --device cuda "${SHAPE[@]}" --steps 6 --warmup 1 2>&1 \
    | tee "$OUT/trl_step_time.txt"
echo "tests/gpu/run.sh: done in ${SECONDS} s; outputs in $OUT"
