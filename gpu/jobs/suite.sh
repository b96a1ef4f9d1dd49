#!/usr/bin/env bash
# GPU job: correctness on the H200, in one call of under 8 minutes.
#  1. the GPU kernel tests, alone (beside starting servers they ran out of time);
#  2. the whole serving suite with the opt-in online-budget arms (GPU_SERVER_ARMS: every arm
#     unless the caller names a subset, e.g. the arms a change touched, with SUITE_K selecting
#     the tests that use them);
#  3. beside both, gpu/jobs/k26_warm.sh: a short K2.6 rank that compiles every kernel the full
#     rank needs (the Marlin MoE kernels take ~5 minutes of nvcc) into the caches this call
#     brings back, and shows that the rank serves before a whole call is spent on it.
# Run through the device command:
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse --short HEAD) bash gpu/jobs/suite.sh
# KERNEL_TESTS_S=0 leaves the kernel tests out (run in the session's first call instead:
# `PRECOMPILE_K26=1 KERNEL_TESTS=1 bash gpu/jobs/topk.sh`).
# $OUT: gpu_tests.log (kernel tests + suite, and whether every collected test finished),
# gpu_server.json, gpu_server_logs.tar.gz, k26-rank_h200_warm.tar.gz: with the cache, Marlin's
# and Triton's, 7 of the 8 files a call brings back (the rest stays in /tmp; the job prints its end).
set -o pipefail
ALL_ARMS=$(python -c "from tests.gpu_server.arms import ARMS; print(','.join(ARMS))")
# K26_WARM=0 leaves the short K2.6 rank out (after a first call's `topk.sh PRECOMPILE_K26=1` the
# Marlin kernels are cached, and the suite's servers then have the machine to themselves).
[ "${K26_WARM:-1}" != 0 ] && bash gpu/jobs/k26_warm.sh > /tmp/k26_warm.log 2>&1 &
# K26_WARM=0 PRECOMPILE_K26=1: only the Marlin kernels beside the suite (~6 minutes of nvcc on the
# idle cores), no short rank: the K2.6 calls that follow then start from a cached build.
if [ "${K26_WARM:-1}" = 0 ] && [ "${PRECOMPILE_K26:-0}" = 1 ]; then
  source gpu/jobs/precompile_k26.sh
  precompile_k26 "${PRECOMPILE_S:-420}"
fi
source gpu/jobs/kernel_tests.sh
if [ "${KERNEL_TESTS_S:-270}" != 0 ]; then  # 0: they ran in this session's first call (topk.sh KERNEL_TESTS=1)
  kernel_tests "${KERNEL_TESTS_S:-270}" "$OUT/gpu_tests.log"
fi
export GPU_SERVER_ARMS="${GPU_SERVER_ARMS:-$ALL_ARMS}"
SELECT=(-m gpu_server tests/gpu_server -p no:cacheprovider --durations=0 ${SUITE_K:+-k "$SUITE_K"})
# The suite gets what is left of JOB_S from the call's start (the call's 600 s less the cache
# upload) unless SUITE_S says otherwise; a cut run is named as such below (its pytest summary
# counts only what ran). The whole suite took more than 400 s at 5ba7f73: SUITE_K splits it.
left=$(( ${JOB_S:-570} - ($(date +%s) - ${DEVICE_T0:-$(date +%s)}) ))
timed_tests "${SUITE_S:-$(( left > 60 ? left : 60 ))}" "$OUT/gpu_tests.log" "${SELECT[@]}"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^(suite complete|SUITE INCOMPLETE)|^  tests/" "$OUT/gpu_tests.log"
wait
tail -5 /tmp/k26_warm.log 2>/dev/null
[ "${PRECOMPILE_K26:-0}" = 1 ] && tail -3 /tmp/precompile_k26.log
exit 0
