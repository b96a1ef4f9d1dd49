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
# $OUT: gpu_tests.log (kernel tests + suite), gpu_server.json, gpu_server_logs.tar.gz,
# k26_warm.{json,md,log}.
set -o pipefail
ALL_ARMS=$(python -c "from tests.gpu_server.arms import ARMS; print(','.join(ARMS))")
bash gpu/jobs/k26_warm.sh > "$OUT/k26_warm.log" 2>&1 &
timeout "${KERNEL_TESTS_S:-270}" python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py \
  tests/test_tree_engine.py tests/test_online_widths.py tests/test_mla_verify.py tests/test_draft_attention.py > "$OUT/gpu_tests.log" 2>&1
tail -1 "$OUT/gpu_tests.log"
GPU_SERVER_ARMS="${GPU_SERVER_ARMS:-$ALL_ARMS}" timeout "${SUITE_S:-400}" python -m pytest -m gpu_server tests/gpu_server \
  -p no:cacheprovider -v -rA ${SUITE_K:+-k "$SUITE_K"} >> "$OUT/gpu_tests.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_tests.log"
wait
tail -5 "$OUT/k26_warm.log"
exit 0
