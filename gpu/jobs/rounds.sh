#!/usr/bin/env bash
# GPU job: the round benchmark on the trained pair: plain, stock DFLASH, DDTREE at budgets
# 7/16/32/64 (7 also with the drafter KV append eager, +eagerkv: what its CUDA graphs save), the
# online budget (ddtree@auto64) and its fallback alone (+width1: every step at width 1, no
# drafter; what falling back to no speculation costs), interleaved per concurrency level
# (1 8 32 64 4 16: the first levels are the ones that must finish), CUDA graphs up to bs 64 in
# every arm, then per-round torch profiles of DFLASH and DDTREE@7 at bs 1, and profiles with
# Python stacks at bs 8 (plain, DFLASH, DDTREE@7, DDTREE@64, the online budget beside it, the
# width-1 fallback): where the host time goes and where the host waits. Five timed passes per arm and level (REPEATS): with three, passes of one level spread
# 1.1-1.8x and the whole job took 320 s of its 540 (985094f).
# PROMPTS_PER_LEVEL: requests per pass at a level (8; a pass at c=4 lasts about 0.4 s).
# PROFILE_ARMS / STACK_PROFILE_ARMS name the profiled arms (none: "-"; an A/B of the arms alone);
# STACK_PROFILE_BS the batch size of the stack profiles (8).
# PRECOMPILE_K26=1 compiles the K2.6 rank's Marlin MoE kernel beside it (one CPU core of
# sixteen, in every arm's time alike) so the cache this call brings back holds it.
# Run through the device command:
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse --short HEAD) bash gpu/jobs/rounds.sh
set -o pipefail
LABEL=${LABEL:-gpu_rounds_pycode-4l_h200}
source gpu/jobs/precompile_k26.sh
[ "${PRECOMPILE_K26:-0}" = 1 ] && precompile_k26 480
timeout "${ROUNDS_S:-560}" python -m lab.bench.gpu_rounds --out "$OUT" --label "$LABEL" \
  --arms "${ARMS:-plain,dflash,ddtree@7,ddtree@7+eagerkv,ddtree@16,ddtree@32,ddtree@64,ddtree@auto64,ddtree@auto64+width1}" \
  --concurrency ${CONC:-1 8 32 64 4 16} --repeats "${REPEATS:-5}" --graph-max-bs 64 \
  --prompts-per-level "${PROMPTS_PER_LEVEL:-8}" \
  --profile-bs ${PROFILE_BS:-1} --profile-arms "${PROFILE_ARMS:-dflash,ddtree@7}" --profile-export-s 30 \
  --stack-profile-arms "${STACK_PROFILE_ARMS:-plain,dflash,ddtree@7,ddtree@64,ddtree@auto64,ddtree@auto64+width1}" --stack-profile-bs "${STACK_PROFILE_BS:-8}" \
  --deadline-s "${ROUNDS_DEADLINE_S:-540}"
wait
tail -2 /tmp/precompile_k26.log 2>/dev/null
rm -rf "$OUT/${LABEL}_work/traces"  # summarised into the JSON; too big to bring back
tar czf "$OUT/${LABEL}_logs.tar.gz" -C "$OUT" "${LABEL}_work" && rm -rf "$OUT/${LABEL}_work"
cat "$OUT/$LABEL.md" 2>/dev/null | head -70
exit 0
