#!/usr/bin/env bash
# GPU job: a short K2.6 rank (K26_WARM_LAYERS layers, default 3) through the A/B tool's K2.6 preset
# (gpu/jobs/ab_k26.sh): plain, the chain, DDTREE@7 and the online budget on the replay drafter,
# 96-token prompts, concurrency 1 and 8, a small memory share so it can run beside the GPU suite's
# servers. It compiles every kernel the full rank needs into the caches the call brings back (with
# gpu/jobs/precompile_k26.py beside it for the Marlin MoE kernels, ~5 minutes of nvcc) and shows
# that the rank's shapes serve through the preset before a whole call is spent on the full rank.
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse HEAD) bash gpu/jobs/k26_warm.sh
# $OUT: k26-rank_h200_warm.tar.gz (the series' json, md, png and logs).
set -o pipefail
S=${K26_WARM_S:-520}
source gpu/jobs/precompile_k26.sh
precompile_k26 "$S"
wait  # the servers would otherwise compile the same kernels themselves, one by one
left=$(( S - ($(date +%s) - ${DEVICE_T0:-$(date +%s)}) ))
LAYERS="${K26_WARM_LAYERS:-3}" MODEL_DIR=/tmp/k26-warm WHAT=warm MEM=0.12 MAX_TOKENS=20000 \
  ARMS=plain,chain,ddtree@7,ddtree@auto7 CONC=1,8 PROMPTS=4,8 REPEATS=1 OUTPUT_LEN=32 \
  TIME_LIMIT_S=$(( left > 90 ? left - 60 : 30 )) AB_S=$(( left > 60 ? left : 60 )) \
  AB_ARGS="--prompts 8 --start-timeout 300" bash gpu/jobs/ab_k26.sh
tail -3 /tmp/precompile_k26.log
# One file back, not four: beside the suite's files and the caches a call brings back at most 8, and
# the Marlin cache this job built must be one of them.
W=(k26-rank_h200_warm.json k26-rank_h200_warm.md k26-rank_h200_warm.png k26-rank_h200_warm_logs.tar.xz)
( cd "$OUT" && tar czf k26-rank_h200_warm.tar.gz --ignore-failed-read "${W[@]}" 2>/dev/null; rm -f "${W[@]}" )
