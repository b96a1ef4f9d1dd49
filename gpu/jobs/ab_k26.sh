#!/usr/bin/env bash
# GPU job: the A/B tool on one Kimi K2.6 TP-8 rank (61 layers, INT4 Marlin experts, dummy weights)
# through its preset (python -m lab.ab_k26): the replay drafter on every speculative arm, plain
# first (its first server records the continuations the others replay), the servers one at a time
# (alternating: the rank fills the H200), every start measured. One call holds four server
# starts with --prelaunch (~100 s each with the Marlin cache carried, the online budget's ~150 s), so a
# series is made of calls, each with the chain and its A/A (chain+again) beside one DDTREE arm,
# merged afterwards (each call's servers the next start of their arms):
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse HEAD) WHAT=ab_call1 ARMS=plain,chain,chain+again bash gpu/jobs/ab_k26.sh
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse HEAD) WHAT=ab_call2 ARMS=chain,ddtree@16,chain+again \
#     AB_ARGS="--recording results/k26-rank_h200_ab_recording.json" bash gpu/jobs/ab_k26.sh
#   python -m sglang_ddtree.ab.merge <call1>.json <call2>.json ... --series k26-rank_h200_ab
# plain's recording comes back as k26-rank_h200_<WHAT>_recording.json: the dummy weights are seeded
# (plain's greedy output was the same on three machines), so a call on a fresh machine can replay
# the committed one (results/k26-rank_h200_ab_recording.json, 96-token prompts, 64 tokens)
# instead of starting plain again: the call's four servers all measure arms.
# Every call works in one folder (/tmp/k26-rank_h200_work: the prompts, plain's recording), so the
# calls' settings name the same files and merge as they are. An arm's +again needs its arm in the
# same call. A server started before TIME_LIMIT_S runs all its passes (the tool's alternating rule).
# ARM+heapq (e.g. ddtree@32+heapq beside ddtree@32): the arm with its tree built by Python's heapq on
# the host, as SGLang's own DDTree builds it (the preset gives it SGLANG_DDTREE_TREE_BACKEND=python).
# The width-1 step on the rank (an online-budget variant that decodes every step it does not draft
# to predict, against plain): ARMS=plain,ddtree@auto7,plain+again
#   AB_ARGS="--recording ... --arm-env ddtree@auto7=SGLANG_DDTREE_BUDGET_COST_TABLE=$PWD/gpu/jobs/width1_cost_table_auto7.json"
# Carry the bundle and the caches, Marlin's included (docs/gpu.md, "What a call carries").
# Writes k26-rank_<device>_<WHAT>.{json,md,png} and its logs (_logs.tar.xz) to $OUT. No pass or server
# starts after TIME_LIMIT_S from the tool's start; the tool is stopped at AB_S. Both default to what
# is left of the call (JOB_S, 560 s from the call's start, less the Marlin build under PRECOMPILE=1),
# so that the report and the caches always come back: AB_S = what is left, TIME_LIMIT_S = AB_S - 150
# (a 61-layer server let in at its gate takes ~40-90 s to start and answer the greedy check, then
# its passes). The preset prelaunches (--prelaunch): each next server's imports and process start-up
# (~50 s of a start) run during the passes before it, held at SGLang's gate until the GPU is free.
# Variables: ARMS, STARTS (1), REPEATS (3: a paired interval needs 3 pairs of passes), CONC (1,4,8,16,32,64: the levels docs/kimi-expectations.md reports), PROMPTS (8,8,16,32,32,64 per level),
# OUTPUT_LEN (64, drawn from [32, 64]), PROMPT_LEN (96), PROFILE (dflash-k25-code or
# pycode-4l-ranks), LAYERS (61; fewer: a quick check that the shapes serve), MEM (0.88: each server's
# --mem-fraction-static), MAX_TOKENS (200000), MODEL_DIR (/tmp/k26-rank), WHAT (ab), AB_ARGS,
# PRECOMPILE=1 (a machine without the Marlin cache: build its kernels first, ~4.5 minutes, in
# parallel, instead of letting the first server build them one after the other).
set -o pipefail
MODEL="${MODEL_DIR:-/tmp/k26-rank}"
SERIES="k26-rank_${DEVICE_NAME:-h200}_${WHAT:-ab}"
RAW="/tmp/${SERIES}_raw"
rm -rf "$RAW"
if [ "${PRECOMPILE:-0}" = 1 ]; then
  source "$(dirname "$0")/precompile_k26.sh"
  precompile_k26 400
fi
python -m lab.models.k26_rank --out "$MODEL" --layers "${LAYERS:-61}" || exit 2
wait && [ "${PRECOMPILE:-0}" = 1 ] && tail -2 /tmp/precompile_k26.log
left=$(( ${JOB_S:-560} - ($(date +%s) - ${DEVICE_T0:-$(date +%s)}) ))
AB_S="${AB_S:-$(( left > 60 ? left : 60 ))}"
TIME_LIMIT_S="${TIME_LIMIT_S:-$(( AB_S > 240 ? AB_S - 150 : 60 ))}"
echo "[ab_k26] the tool gets ${AB_S} s; no server starts after ${TIME_LIMIT_S} s"
timeout -s TERM "$AB_S" python -m lab.ab_k26 --model "$MODEL/target" --drafter "$MODEL/drafter" \
  --prompt-len "${PROMPT_LEN:-96}" --profile "${PROFILE:-dflash-k25-code}" --work /tmp/k26-rank_h200_work \
  --mem-fraction-static "${MEM:-0.88}" --max-total-tokens "${MAX_TOKENS:-200000}" \
  --arms "${ARMS:-plain,chain,ddtree@7,chain+again}" --starts "${STARTS:-1}" --repeats "${REPEATS:-3}" \
  --concurrency "${CONC:-1,4,8,16,32,64}" --num-prompts "${PROMPTS:-8,8,16,32,32,64}" --output-len "${OUTPUT_LEN:-64}" \
  --time-limit "$TIME_LIMIT_S" --start-timeout 400 --keep-going \
  --device-name "${DEVICE_NAME:-h200}" --series "$SERIES" --results-dir "$OUT" --raw-dir "$RAW" --no-index ${AB_ARGS:-}
rc=$?
cp /tmp/k26-rank_h200_work/recording.json "$OUT/${SERIES}_recording.json" 2>/dev/null  # see above
source "$(dirname "$0")/ab_logs.sh"
bring_back_logs "$RAW" "$SERIES"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
head -60 "$OUT/$SERIES.md" 2>/dev/null
exit $rc
