#!/usr/bin/env bash
# GPU checks (never in CI: no GPU there). Needs one CUDA GPU and the project's venv; downloads nothing (every model
# is built from a config with random weights). About 2-4 minutes on one GPU (an estimate: not run yet, see README).
#   1. pytest -m gpu tests/gpu: cuda placement, bf16 on GPU with fp32 optimizer state, FSDP2 with NCCL on one GPU
#      (train, sharded checkpoint, reload, export);
#   2. the quickstart on cuda (one seed, 3 steps of its config so the check stays short), printing its summary.
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

"$PY" -m pytest tests/gpu -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt"

start=$(date +%s)
"$PY" -m rlctl.cli.app train configs/quickstart.yaml train.device=cuda rollout.options.device=cuda train.seeds=1 \
    train.steps=3 --run-dir "$OUT/quickstart" --json > "$OUT/quickstart.json"
echo "quickstart on cuda (3 steps): $(( $(date +%s) - start )) s wall; summary in $OUT/quickstart.json"
"$PY" - "$OUT/quickstart.json" <<'PY'
import json, sys
out = json.load(open(sys.argv[1]))
metrics = out.get("last_metrics") or {}
print("status:", out["run"]["status"], "| wall_s:", out.get("wall_s"), "| last metrics:",
      {k: v for k, v in metrics.items() if k in ("reward_mean", "loss", "step_time_s")})
PY
