#!/usr/bin/env bash
# GPU checks (never in CI: no GPU there), made for the GPU machine as it is: its own python3 (PY=... to use
# another), its torch and Hugging Face stack, no network. What the image lacks travels as wheels: run
# `bash scripts/gpu_wheels.sh` here first (fills the git-ignored .whl/, ~10 MiB) and carry .whl with the tree.
# Nothing is downloaded: every model is built from a config with random weights. docs/gpu.md has the details.
#
# Steps, each under its own time limit (seconds; 540 s = 9 min in all, plus at most 5 s per step for a kill):
#   setup        20  tests/gpu/prepare.py install: the wheels from .whl/ that the image lacks (or has at a version
#                    outside rlctl's range) and rlctl itself (editable, --no-deps) into $WORK/site, for PYTHONPATH;
#                    a requirement neither the image nor .whl/ meets stops the run here, named;
#   imports      45  prepare.py check: every module the run needs imports (versions printed); else stop, named
#                    (a cold first import of torch with its CUDA libraries can take a while);
#   cuda         15  torch sees a CUDA device; else stop with "no CUDA device" (exit 3);
#   pytest      150  pytest -m gpu tests/gpu: cuda placement and fp32 reconciliation, bf16 with fp32 optimizer
#                    state, FSDP2 over NCCL (train, sharded checkpoint, reload, export), an FSDP2 rank as a Ray
#                    actor (skips: ray does not travel), a colocated engine's KV budget and weight offload;
#   quickstart  110  the quickstart on cuda, 3 steps of its config, one seed, the final eval; its warm start (SFT
#                    of the built-in tiny model, on the CPU whatever the device) capped at 300 steps: to its
#                    accuracy target it took 1,400 steps, 2 min 50 s on one thread here, over the budget;
#   fsdp_ledger 100  a ~0.5B Qwen2-shaped model (494M parameters, random weights), 5 GRPO steps with the fsdp2
#                    learner (world_size 1, bf16 + fp32 master shards): step time, peak of
#                    torch.cuda.max_memory_allocated, dry-run ledger vs the allocator per role (bench/fsdp_ledger.py);
#   trl_step_time 100  rlctl's GRPO step vs TRL's GRPOTrainer on that model and settings (bench/trl_step_time.py).
# Outputs: $OUT (default .gpu-run/), 7 files: setup.txt, pytest.txt, quickstart.json, quickstart.txt,
# fsdp_ledger.txt, trl_step_time.txt, summary.txt (the table printed at the end). Scratch (site, models, the
# quickstart's run directory) goes to $WORK, outside $OUT.
# Exit status: 0 every step passed, 1 a check step failed, 2 setup or imports failed, 3 no CUDA device.
# BUDGET_SCALE=N multiplies every budget (default 1), for a slow or shared machine such as a CPU dry run here.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PY:-python3}
OUT=${OUT:-$REPO/.gpu-run}
WORK=${WORK:-${TMPDIR:-/tmp}/rlctl-gpu}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
export RLCTL_HOME=${RLCTL_HOME:-$WORK/home}
mkdir -p "$OUT" "$WORK"
rm -rf "$WORK/site" "$WORK/quickstart"
rm -f "$OUT"/{setup,pytest,quickstart,fsdp_ledger,trl_step_time,summary}.txt "$OUT/quickstart.json"

STEPS=(setup:20 imports:45 cuda:15 pytest:150 quickstart:110 fsdp_ledger:100 trl_step_time:100)
ROWS=()
summary() {
    local done=${#ROWS[@]} i
    for (( i = done; i < ${#STEPS[@]}; i++ )); do
        ROWS+=("${STEPS[i]%%:*} $(( ${STEPS[i]##*:} * ${BUDGET_SCALE:-1} )) - -")
    done
    echo
    "$PY" tests/gpu/summary.py "$OUT" "${ROWS[@]}"
}
trap summary EXIT

# run_step LOG CMD...: the next step of STEPS under its budget; output to the console and appended to LOG
run_step() {
    local step=${STEPS[${#ROWS[@]}]} log=$1 t0=$SECONDS rc
    local budget=$(( ${step##*:} * ${BUDGET_SCALE:-1} ))
    shift
    echo "== ${step%%:*} (budget $budget s): $*" | tee -a "$log"
    timeout -k 5 "$budget" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    ROWS+=("${step%%:*} $budget $(( SECONDS - t0 )) $rc")
    return "$rc"
}

run_step "$OUT/setup.txt" env -u PYTHONPATH "$PY" tests/gpu/prepare.py install --site "$WORK/site" || exit 2
export PYTHONPATH=$REPO:$REPO/plugins:$WORK/site${PYTHONPATH:+:$PYTHONPATH}
run_step "$OUT/setup.txt" "$PY" tests/gpu/prepare.py check || exit 2
run_step "$OUT/setup.txt" "$PY" tests/gpu/prepare.py cuda || exit 3

failed=0
run_step "$OUT/pytest.txt" "$PY" -m pytest tests/gpu -m gpu -q -p no:cacheprovider -rs || failed=1

# stdout (the JSON summary) to quickstart.json; stderr to quickstart.txt and the console
run_step "$OUT/quickstart.txt" bash -c 'exec "$@" > "$0"' "$OUT/quickstart.json" \
    "$PY" -m rlctl.cli.app train configs/quickstart.yaml train.device=cuda rollout.options.device=cuda \
    train.seeds=1 train.steps=3 model.warm_start.steps=300 model.warm_start.target_dev_accuracy=null \
    --run-dir "$WORK/quickstart" --json || failed=1

SHAPE=(--shape qwen2-0.5b --vocab qwen --prompts 8 --group 4 --max-tokens 64 --models "$WORK/models")
run_step "$OUT/fsdp_ledger.txt" "$PY" bench/fsdp_ledger.py --device cuda "${SHAPE[@]}" --steps 5 \
    --micro-batch 8 || failed=1
run_step "$OUT/trl_step_time.txt" "$PY" bench/trl_step_time.py --device cuda "${SHAPE[@]}" --steps 6 \
    --warmup 1 || failed=1
exit "$failed"
