#!/usr/bin/env bash
# Interleave a benchmark between two source trees, so both see the same machine load; print each run's table.
#   scripts/bench_before_after.sh BASE_TREE OUT_DIR REPEATS -- bench/grpo_vs_trl.py [ARGS...]
# Each tree runs with its own .venv (make it with: python3 -m venv .venv && .venv/bin/pip install -e '.[bench]').
# Runs alternate base, this tree, base, this tree, ... REPEATS times each, on CPU 0 (taskset -c 0), one thread.
# Every run's output goes to OUT_DIR/<base|head>-<i>.txt; compare the tables' ratio columns (medians per tree).
set -euo pipefail
base=$(cd "$1" && pwd); out=$2; repeats=$3; shift 3
[ "$1" = "--" ] && shift
head=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
for i in $(seq 1 "$repeats"); do
  for side in base head; do
    tree=$base; [ "$side" = head ] && tree=$head
    echo "== $side run $i ($tree)" >&2
    (cd "$tree" && OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python "$@") > "$out/$side-$i.txt" 2>&1 \
      || { echo "$side run $i failed; see $out/$side-$i.txt" >&2; exit 1; }
    grep -E "^\|" "$out/$side-$i.txt" | head -20 >&2 || true
  done
done
