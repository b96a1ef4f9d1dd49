#!/usr/bin/env bash
# GPU job: the online budget's host time per step on the GPU host (lab/bench/online_budget_host.py,
# tensors on the GPU, served rounds spun between steps), this checkout's package against another
# copy of it (BEFORE_DIR, carried: `mkdir -p .carry/before && git archive <commit> sglang_ddtree |
# tar -x -C .carry/before`), REPEATS interleaved runs of each (the host's speed drifts):
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse --short HEAD) BEFORE_DIR=.carry/before bash gpu/jobs/budget_host_ab.sh
# Writes each run (online-budget_<device>_host_time_served_{after,before}_<repeat>.{json,md}, or
# SERIES_...) to $OUT and prints its rows, then, with BEFORE_DIR, folds them into one series
# (lab/bench/online_budget_host_ab.py). Variables: ROUND_US (2000), JITTER (0.25), STEPS (1500),
# BATCH_SIZES ("1 8"), CHURN (0: the share of steps whose batch loses a request or gets it back),
# SERIES, BEFORE_COMMIT. It runs on a CPU too (DEVICE_NAME=cpu OUT=<folder>: tensors on the host).
set -o pipefail
ROOT="$(pwd)"
NAME="${SERIES:-online-budget_${DEVICE_NAME:-gpu}_host_time_served}"
ARGS=(--budgets 64 --batch-sizes ${BATCH_SIZES:-1 8} --round-us "${ROUND_US:-2000}" --jitter "${JITTER:-0.25}"
  --steps "${STEPS:-1500}" --warmup 400 --churn "${CHURN:-0}" --out "$OUT")
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
# the runs as one series (NAME.{json,md}; the per-run files go): BEFORE_COMMIT names the package
# in BEFORE_DIR, BENCH_COMMIT this checkout's
[ -z "${BEFORE_DIR:-}" ] && exit 0
python -m lab.bench.online_budget_host_ab "$OUT" "$NAME" --before "${BEFORE_COMMIT:-unknown}" \
  --after "${BENCH_COMMIT:-$(git rev-parse --short HEAD)}" \
  --command "env BEFORE_DIR=<the package at ${BEFORE_COMMIT:-unknown}> REPEATS=${REPEATS:-2} STEPS=${STEPS:-1500} ROUND_US=${ROUND_US:-2000} JITTER=${JITTER:-0.25} CHURN=${CHURN:-0} BATCH_SIZES='${BATCH_SIZES:-1 8}' bash gpu/jobs/budget_host_ab.sh"
