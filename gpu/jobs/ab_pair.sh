#!/usr/bin/env bash
# GPU job: the A/B tool (python -m sglang_ddtree.ab) on the trained pair (lab/models/pairs/pycode-4l),
# bf16, CUDA graphs up to bs 64, triton attention and the pytorch sampler as the GPU suite serves:
# plain, stock DFLASH, the chain as DDTREE (max-topk 1), DDTREE@16/32/64, the online budget
# (ddtree@auto64) and a second DFLASH server (dflash+again: the run's A/A), all eight servers up at
# once (interleaved: 8 x --mem-fraction-static 0.08 = 0.64 of the H200), c = 1, 4, 16, 64 in that
# order, REPEATS passes per arm and level, each repeat one pass of every arm in a rotated order.
# Load: the held-out Python prompts (token ids) through sglang.bench_serving, output lengths drawn
# from [OUTPUT_LEN/2, OUTPUT_LEN] (the same for every arm).
# Writes the series pycode-4l_<device>_ab.{json,md,png} (<device>: the GPU the call got, e.g. h200) and its server/bench logs
# (pycode-4l_<device>_ab_logs.tar.xz) to $OUT. Run through the device command, carrying the bundle
# and the compile caches (docs/gpu.md, "What a call carries"):
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse HEAD) bash gpu/jobs/ab_pair.sh
# Time: the servers start together (~1-2 min with the caches carried; the online budget's arm
# captures a verify graph set per width and starts last), then 8 arms x 4 levels x REPEATS
# passes of ~2.5 s each (a pass: bench_serving's warm-up at the level's concurrency, the cache
# flush, its 1 s pause, then the timed requests): ~5.5 min at REPEATS=4. No pass starts after
# TIME_LIMIT_S (400) from the tool's start, and the tool is stopped at AB_S (440; it writes what
# was measured): the job ends within ~8 min. Passes past the limit are listed as skipped; an arm
# whose server does not start within 360 s is dropped and reported (--keep-going), the rest measured.
# Variables: SERIES (pycode-4l_<device>_ab), REPEATS (4), CONC (1,4,16,64), PROMPTS (8,16,48,128: requests per pass, one per
# level), OUTPUT_LEN (128), ARMS, TIME_LIMIT_S, AB_S, AB_ARGS (more flags for the tool, last).
# More arms, each a ninth server beside the eight (9 x 0.08 still fits the H200):
#  - ddtree@auto64+width1 (a variant: ddtree@auto64 stays in ARMS): the online budget's fallback to
#    no speculation alone. The job passes it
#    `--arm-env ddtree@auto64+width1=SGLANG_DDTREE_BUDGET_COST_TABLE=gpu/jobs/width1_cost_table_auto64.json`,
#    a fixed cost table in which width 1 is far cheaper than any tree at every batch size: every step
#    verifies the root alone without the drafter; against plain, what falling back costs.
#  - ddtree@auto64+step1: the same, with no width-1 step drafting once a prediction is made
#    (SGLANG_DDTREE_ONLINE_BUDGET_REFRESH_EVERY=0): the width-1 step alone, without the drafted
#    steps that refresh the prediction (against plain: what a width-1 step costs; +width1 beside
#    it: what its refreshes add).
#  - ddtree@auto64+step1phases: +step1 with the phase timer and a stats line every 2,000 rounds
#    (its `plain_steps`: the width-1 steps SGLang ran as its own decode steps): where a width-1
#    step's time goes. Diagnostics only: compare +step1 (untimed) with plain.
#  - ddtree@auto64+pinned: the online budget choosing and recording as ever, every step run at the
#    widest tree (SGLANG_DDTREE_ONLINE_BUDGET_PIN_WIDEST=1): against DDTREE@64, what its own work
#    costs; against ddtree@auto64, what its choices gain or lose (at bs 1 on the trained pair it
#    chooses width 64 over the graph's 65 by the verify's device time, which a host-bound round
#    may hide, and pays the cut of the tree on the host).
#  - ARM+phases (e.g. ddtree@32+phases): the DDTREE worker's host time per round phase (docs/ab.md).
#  - ARM+heapq (e.g. ddtree@32+heapq, a variant the tool knows): the same arm with its tree built
#    by Python's heapq on the host, as SGLang's own DDTree builds it: today's service.
#  - TIMED=ARM (e.g. TIMED=ddtree@auto64): a variant ARM+timed beside ARM with the scheduler's
#    stages per decode step and their cProfile (lab/bench/step_timer.py: the launches and the
#    scheduling of decode steps, where the online budget chooses), and the worker's phases; the
#    timers' lines and the profile's top in diagnostics.txt inside the logs' tarball.
#    Diagnostics only: compare the untimed arms.
# Torch profiles of chosen arms at chosen levels: AB_ARGS="--profile dflash@1,ddtree@32@16"
# (docs/ab.md; the traces stay out of the logs brought back, their summaries are in the series).
set -o pipefail
P=lab/models/pairs/pycode-4l
SERIES="${SERIES:-pycode-4l_${DEVICE_NAME:-h200}_ab}"
RAW=/tmp/ab_pair_raw
rm -rf "$RAW" && mkdir -p "$RAW"
source "$(dirname "$0")/pair_server_args.sh"
COMMON="$PAIR_SERVER_ARGS"
ARMS="${ARMS:-plain,dflash,chain,ddtree@16,ddtree@32,ddtree@64,ddtree@auto64,dflash+again}"
ARM_ENV=()
WIDTH1_TABLE="SGLANG_DDTREE_BUDGET_COST_TABLE=$PWD/gpu/jobs/width1_cost_table_auto64.json"
case ",$ARMS," in *,ddtree@auto64+width1,*) ARM_ENV+=(--arm-env "ddtree@auto64+width1=$WIDTH1_TABLE");; esac
case ",$ARMS," in *,ddtree@auto64+step1,*)
  ARM_ENV+=(--arm-env "ddtree@auto64+step1=$WIDTH1_TABLE SGLANG_DDTREE_ONLINE_BUDGET_REFRESH_EVERY=0");;
esac
case ",$ARMS," in *,ddtree@auto64+pinned,*)
  ARM_ENV+=(--arm-env "ddtree@auto64+pinned=SGLANG_DDTREE_ONLINE_BUDGET_PIN_WIDEST=1");;
esac
case ",$ARMS," in *,ddtree@auto64+step1phases,*)
  ARM_ENV+=(--arm-env "ddtree@auto64+step1phases=$WIDTH1_TABLE SGLANG_DDTREE_ONLINE_BUDGET_REFRESH_EVERY=0 SGLANG_DDTREE_PHASE_TIMES=64"
            --arm-args "ddtree@auto64+step1phases=--speculative-ddtree-stats-interval 2000");;
esac
if [ -n "${TIMED:-}" ]; then
  ARMS="$ARMS,$TIMED+timed"
  TIMER="SGLANG_DDTREE_TEST_PLUGIN=lab.gpu_compat,lab.bench.step_timer SGLANG_STEP_TIMER_EVERY=64"
  ARM_ENV+=(--arm-env "$TIMED+timed=$TIMER SGLANG_STEP_TIMER_PROFILE=$RAW/${SERIES}_timed.pstats SGLANG_DDTREE_PHASE_TIMES=64")
fi
timeout -s TERM "${AB_S:-440}" python -m sglang_ddtree.ab \
  --model "$P/target" --drafter "$P/drafter" --server-args "$COMMON" --arms "$ARMS" "${ARM_ENV[@]}" \
  --schedule interleaved --concurrency "${CONC:-1,4,16,64}" --num-prompts "${PROMPTS:-8,16,48,128}" \
  --repeats "${REPEATS:-4}" --time-limit "${TIME_LIMIT_S:-400}" \
  --dataset custom --dataset-path "$P/heldout_prompts.json" \
  --output-len "${OUTPUT_LEN:-128}" --range-ratio 0.5 \
  --check-prompts 4 --check-tokens 32 --start-timeout 360 --keep-going \
  --label pycode-4l --device-name "${DEVICE_NAME:-h200}" --series "$SERIES" \
  --results-dir "$OUT" --raw-dir "$RAW" --no-index ${AB_ARGS:-}
rc=$?
source "$(dirname "$0")/ab_logs.sh"
write_diagnostics "$RAW" "$SERIES"
bring_back_logs "$RAW" "$SERIES"
# the last timer lines of any +timed or +phases arm (the worker's phases: the online budget's own
# host work is its `width choice` and `width record`)
grep -h "STEP TIMER us/step\|DDTREE phase host us/round" "$RAW/diagnostics.txt" 2>/dev/null | tail -6
nvidia-smi --query-gpu=memory.used --format=csv,noheader
head -60 "$OUT/$SERIES.md" 2>/dev/null
exit $rc
