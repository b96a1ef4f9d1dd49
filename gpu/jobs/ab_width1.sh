#!/usr/bin/env bash
# GPU job: a width-1-only online budget against plain decoding through the A/B tool, on the trained
# pair (lab/models/pairs/pycode-4l), as ab_pair.sh serves it (bf16, CUDA graphs up to bs 64, triton
# attention, the pytorch sampler). Issue 48: does a width-1 step (adapter/decode_step.py) cost at
# most 1.05x a plain decode step at c = 1, 8, 32, 64? lab/notes/no-spec-step.md says what to read.
# Arms:
#   plain, plain+again           the baseline and the run's A/A;
#   ddtree@auto64                --speculative-ddtree-budget auto (trees up to 64 nodes) WITH an
#                                injected cost table where width 1 wins at every batch size (its
#                                --arm-env), so every step but the ones that draft to predict is a
#                                decoding step: the width-1-only arm;
#   ddtree@auto64+frame (FRAME=1, the default): the same with SGLANG_DDTREE_PLAIN_STEPS=0, every
#                                width-1 step inside SGLang's speculative frame: what the plain
#                                steps (adapter/plain_steps.py) save, paired in the same call;
#   plain+timed, ddtree@auto64+timed (TIMED=1, the default): the same with the scheduler's
#                                stages per decode step (lab/bench/step_timer.py) and, in the DDTREE
#                                arm, the worker's phases (SGLANG_DDTREE_PHASE_TIMES): where a step's
#                                host time goes. Diagnostics only: compare the untimed arms.
#   PROFILE (plain@1,ddtree@auto64@1; empty: none): the tool's profile of both untimed arms at c=1 (the device's
#                                busy and idle time per step: does the width-1 step lose on the
#                                device, or wait for the host? results/tiny_cpu_width1_ops.md has
#                                the host side: ~14 more launches a step than plain's).
# Read: the series' ITL and tok/s per level (width1 / plain), then in the logs the lines
# "STEP TIMER us/step" and "STEP TIMER syncs/step" (both timed arms; a step that waits for the
# device loses the overlap) and "DDTREE phase host us/round" (lab/notes/no-spec-step.md, "On the
# H200 next").
# Writes the series pycode-4l_<device>_width1_ab.{json,md,png} (<device>: the GPU the call got) and its logs to $OUT:
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse HEAD) bash gpu/jobs/ab_width1.sh
# Time: five servers up at once (~1-2 min with the caches carried; the DDTREE arm captures a verify
# graph set per width), then 5 arms x 4 levels x REPEATS passes of ~2.5 s: ~4 min at REPEATS=4; no
# pass starts after TIME_LIMIT_S (400), the tool is stopped at AB_S (440).
# STEP_PROFILE=1: the timed arms also run their decode launches under cProfile
# (SGLANG_STEP_TIMER_PROFILE), written to <SERIES>_<arm>.pstats in the logs' tarball: where the host
# time of a step goes, function by function (`python -m pstats FILE`); the tarball's
# diagnostics.txt holds the timers' lines and each profile's top 45.
# BEFORE_DIR: a folder holding another sglang_ddtree package (carried, e.g. `mkdir -p .carry/before &&
# git archive <commit> sglang_ddtree | tar -x -C .carry/before`, then carry .carry/before): the arm
# ddtree@auto64+before serves the width-1-only arm from it, so a change to the step is paired with
# the step before it in one call.
# FIT_TO_CALL_S: run in what is left of a call of that many seconds from its start (DEVICE_T0):
# TIME_LIMIT_S and AB_S follow from it, nothing runs with less than MIN_LEFT_S (150) left.
# Variables: SERIES (pycode-4l_<device>_width1_ab), FRAME (1), REPEATS (4), CONC (1,8,32,64), PROMPTS (8,32,96,128), OUTPUT_LEN (128), TIMED (1), STEP_PROFILE (0), PROFILE,
# TIME_LIMIT_S, AB_S, AB_ARGS (more flags for the tool, last).
set -o pipefail
if [ -n "${FIT_TO_CALL_S:-}" ]; then  # a job's later stage: what is left of a call of FIT_TO_CALL_S seconds
  left=$(( FIT_TO_CALL_S - ($(date +%s) - ${DEVICE_T0:-$(date +%s)}) ))
  echo "[ab_width1] ${left} s left of the call"
  [ "$left" -lt "${MIN_LEFT_S:-150}" ] && exit 0
  TIME_LIMIT_S=$(( left - 90 )) AB_S=$(( left - 20 ))
fi
P=lab/models/pairs/pycode-4l
SERIES="${SERIES:-pycode-4l_${DEVICE_NAME:-h200}_width1_ab}"
RAW=/tmp/ab_width1_raw
rm -rf "$RAW" && mkdir -p "$RAW"
TABLE="$RAW/width1_costs_64.json"
python - "$TABLE" <<'EOF'
import json, sys
from sglang_ddtree.budget import candidate_widths
widths = list(candidate_widths(64))
sizes = [1 << i for i in range(10)]
row = [1.0 if w == 1 else 1e6 for w in widths]
json.dump({"batch_sizes": sizes, "widths": widths, "ms": [row] * len(sizes)}, open(sys.argv[1], "w"))
EOF
TIMER="SGLANG_DDTREE_TEST_PLUGIN=lab.gpu_compat,lab.bench.step_timer SGLANG_STEP_TIMER_EVERY=64"
ARMS_DEFAULT="plain,ddtree@auto64,plain+again"
# the arm's environment reaches its variants (docs/ab.md): ddtree@auto64+timed runs width 1 too
ARM_ENV=(--arm-env "ddtree@auto64=SGLANG_DDTREE_BUDGET_COST_TABLE=$TABLE")
if [ "${FRAME:-1}" = 1 ]; then  # the same width-1 steps all kept in SGLang's speculative frame
  ARMS_DEFAULT="$ARMS_DEFAULT,ddtree@auto64+frame"
  ARM_ENV+=(--arm-env "ddtree@auto64+frame=SGLANG_DDTREE_PLAIN_STEPS=0")
fi
if [ "${TIMED:-1}" = 1 ]; then
  ARMS_DEFAULT="$ARMS_DEFAULT,plain+timed,ddtree@auto64+timed"
  profiled() {  # STEP_PROFILE=1: the arm's cProfile of its decode launches, brought back in the logs
    [ "${STEP_PROFILE:-0}" = 1 ] && echo " SGLANG_STEP_TIMER_PROFILE=$RAW/${SERIES}_$1.pstats"
  }
  ARM_ENV+=(--arm-env "plain+timed=$TIMER$(profiled plain-timed)")
  ARM_ENV+=(--arm-env "ddtree@auto64+timed=$TIMER$(profiled ddtree-auto64-timed) SGLANG_DDTREE_PHASE_TIMES=64")
fi
if [ -n "${BEFORE_DIR:-}" ]; then  # the same width-1-only arm served from another copy of the package
  ARMS_DEFAULT="$ARMS_DEFAULT,ddtree@auto64+before"
  ARM_ENV+=(--arm-env "ddtree@auto64+before=PYTHONPATH=$(cd "$BEFORE_DIR" && pwd):${PYTHONPATH:-}")
fi
PROFILE="${PROFILE-plain@1,ddtree@auto64@1}"  # PROFILE= (empty): no profile
PROFILE_ARGS=()
[ -n "$PROFILE" ] && PROFILE_ARGS=(--profile "$PROFILE")
COMMON="--attention-backend triton --sampling-backend pytorch --dtype bfloat16 --max-total-tokens 65536"
COMMON="$COMMON --mem-fraction-static 0.1 --max-running-requests 64 --cuda-graph-max-bs-decode 64"
timeout -s TERM "${AB_S:-440}" python -m sglang_ddtree.ab \
  --model "$P/target" --drafter "$P/drafter" --server-args "$COMMON" \
  --arms "${ARMS:-$ARMS_DEFAULT}" "${ARM_ENV[@]}" \
  --schedule interleaved --concurrency "${CONC:-1,8,32,64}" --num-prompts "${PROMPTS:-8,32,96,128}" \
  --repeats "${REPEATS:-4}" --time-limit "${TIME_LIMIT_S:-400}" \
  --dataset custom --dataset-path "$P/heldout_prompts.json" \
  --output-len "${OUTPUT_LEN:-128}" --range-ratio 0.5 \
  --check-prompts 4 --check-tokens 32 --start-timeout 360 --keep-going \
  "${PROFILE_ARGS[@]}" \
  --label pycode-4l --device-name "${DEVICE_NAME:-h200}" --series "$SERIES" \
  --results-dir "$OUT" --raw-dir "$RAW" --no-index ${AB_ARGS:-}
rc=$?
source "$(dirname "$0")/ab_logs.sh"
write_diagnostics "$RAW" "$SERIES"
bring_back_logs "$RAW" "$SERIES"
grep -h "STEP TIMER us/step\|DDTREE phase host us/round" "$RAW/diagnostics.txt" | tail -12
head -60 "$OUT/$SERIES.md" 2>/dev/null
exit $rc
