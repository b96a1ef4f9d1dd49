#!/usr/bin/env bash
# GPU job: the online budget's host time per step on the GPU host (lab/bench/online_budget_host.py,
# tensors on the GPU, served rounds spun between steps), this checkout's package against another
# copy of it (BEFORE_DIR, carried: `mkdir -p .carry/before && git archive <commit> sglang_ddtree |
# tar -x -C .carry/before`), REPEATS interleaved runs of each (the host's speed drifts):
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse --short HEAD) BEFORE_DIR=.carry/before bash gpu/jobs/budget_host_ab.sh
# Writes online-budget_<device>_host_time_served_{after,before}_<repeat>.{json,md} to $OUT and prints
# each run's rows. Variables: ROUND_US (2000), JITTER (0.25), STEPS (1500), BATCH_SIZES ("1 8").
set -o pipefail
ROOT="$(pwd)"
NAME="online-budget_${DEVICE_NAME:-gpu}_host_time_served"
ARGS=(--budgets 64 --batch-sizes ${BATCH_SIZES:-1 8} --round-us "${ROUND_US:-2000}" --jitter "${JITTER:-0.25}"
  --steps "${STEPS:-1500}" --warmup 400 --out "$OUT")
if [ -n "${BEFORE_DIR:-}" ]; then
  BEFORE="$(cd "$BEFORE_DIR" && pwd)"
  ln -sfn "$ROOT/lab" "$BEFORE/lab"  # the same benchmark, the other package (the folder run from comes first)
fi
for r in $(seq 1 "${REPEATS:-2}"); do
  if [ -n "${BEFORE_DIR:-}" ]; then
    (cd "$BEFORE" && python -m lab.bench.online_budget_host "${ARGS[@]}" --name "${NAME}_before_$r" > /dev/null) \
      && echo "before $r" && grep "^| 64" "$OUT/${NAME}_before_$r.md"
  fi
  python -m lab.bench.online_budget_host "${ARGS[@]}" --name "${NAME}_after_$r" > /dev/null \
    && echo "after $r" && grep "^| 64" "$OUT/${NAME}_after_$r.md"
done
