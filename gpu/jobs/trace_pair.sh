#!/usr/bin/env bash
# GPU job: the trained pair's real draws as a trace, and the trace replay's self-check on the pair
# (python -m lab.bench.trace_pair; lab/notes/trace-replay.md). The pair (lab/models/pairs/pycode-4l)
# served as ab_pair.sh serves it (bf16, triton attention, the pytorch sampler, CUDA graphs up to
# bs 64): the chain and DDTREE@7/16/32/64 with the real drafter and the draw recorder (the tree step
# eager: the recorder reads every round's top-k), all five servers up at once, the held-out prompts
# one at a time, greedy; then the union trace of the five arms on the chain's greedy continuation;
# then the five arms again with the replay drafter on that trace. The report compares per arm the
# served tokens per round with the replayed (within 2%: the self-check), the requests whose rounds
# rooted at the same positions, identical outputs, and the replay's rounds that found no record.
# Writes pycode-4l_h200_trace_selfcheck.{json,md}, the trace pycode-4l_h200_trace.json.gz (what
# `python -m lab.ab_k26 --trace` replays; commit it beside the pair) and the server logs
# (pycode-4l_h200_trace_logs.tar.gz) to $OUT. Run through the device command, carrying the bundle
# and the compile caches (docs/gpu.md, "What a call carries"):
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse HEAD) bash gpu/jobs/trace_pair.sh
# Time: two rounds of five server starts (~1-2 min each with the caches carried) and 2 x 5 arms x
# PROMPTS requests of OUTPUT_LEN tokens one at a time (~10-20 s an arm): ~6-7 min; the tool is
# stopped at TRACE_S (540) so that the caches still come back.
# Variables: ARMS (chain,7,16,32,64), PROMPTS (0: all 43 held-out prompts), OUTPUT_LEN (128: the
# K2.6 rank's A/B draws up to 64), TOPK (64: ranks the trace keeps per depth), TRACE_S, TRACE_ARGS,
# SERVER_ARGS (the servers' flags; empty with SGLANG_USE_CPU_ENGINE=1: the job's plumbing on a CPU),
# DRAFTER (drafter: the pair's own; another folder of the pair, e.g. one gpu/jobs/train_drafter.sh
# trained, names the series pycode-4l-<DRAFTER>_h200_trace).
set -o pipefail
P=lab/models/pairs/pycode-4l
DRAFTER="${DRAFTER:-drafter}"
NAME=pycode-4l_h200_trace
[ "$DRAFTER" != drafter ] && NAME="pycode-4l-${DRAFTER}_h200_trace"
WORK=/tmp/trace_pair_work
rm -rf "$WORK"
source "$(dirname "$0")/pair_server_args.sh"
COMMON="$PAIR_SERVER_ARGS"
timeout -s TERM "${TRACE_S:-540}" python -m lab.bench.trace_pair --pair "$P" --drafter "$DRAFTER" \
  --arms "${ARMS:-chain,7,16,32,64}" --prompts "${PROMPTS:-0}" --output-len "${OUTPUT_LEN:-128}" \
  --topk "${TOPK:-64}" --server-args "${SERVER_ARGS-$COMMON}" --work "$WORK" \
  --trace-out "$OUT/$NAME.json.gz" --out "$OUT" --name "${NAME}_selfcheck" ${TRACE_ARGS:-}
rc=$?
logs=$(cd "$WORK" 2>/dev/null && ls record/*.log replay/*.log 2>/dev/null)
[ -n "$logs" ] && tar czf "$OUT/${NAME}_logs.tar.gz" -C "$WORK" $logs
nvidia-smi --query-gpu=memory.used --format=csv,noheader
cat "$OUT/${NAME}_selfcheck.md" 2>/dev/null
exit $rc
