#!/usr/bin/env bash
# GPU job: a short K2.6 rank (K26_WARM_LAYERS layers, default 3; plain and DDTREE@8 on the
# replay drafter, 96-token prompts, concurrency 1 and 4, a small memory share so it can run
# beside other servers). It compiles every kernel the full rank needs into the caches the
# call brings back (with gpu/jobs/precompile_k26.py beside it for the Marlin MoE kernels) and
# shows that the rank's shapes serve before a whole call is spent on the full rank.
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse --short HEAD) bash gpu/jobs/k26_warm.sh
# $OUT: k26_warm.{json,md,png}, k26_warm_logs.tar.gz.
set -o pipefail
S=${K26_WARM_S:-450}
source gpu/jobs/precompile_k26.sh
precompile_k26 "$S"
LAYERS="${K26_WARM_LAYERS:-3}" K26_MODEL_DIR=/tmp/k26-warm LABEL=k26_warm ARMS=plain,ddtree@8 JOB_S="$S" \
  DEADLINE_S=$(( S - 20 )) K26_AB_ARGS="--profiles pycode-4l --prompt-lens 96 --concurrency 1 4 \
  --prompts 8 --start-timeout 420 --common-extra=--mem-fraction-static=0.12,--max-total-tokens=20000" \
  bash gpu/jobs/k26_rank.sh
wait
cat /tmp/precompile_k26.log
