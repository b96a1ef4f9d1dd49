#!/usr/bin/env bash
# GPU job (one H200, about 3 minutes): the draft top-k kernels' GPU tests (exact ids, log-probs
# against the float32 reference, CUDA-graph replay on a reused workspace), then the top-k
# benchmark: the split-vocabulary kernel beside the one-block-per-row kernel in the same run, at
# the batch sizes and k of the targets (bs 1 and 64, k up to 64, vocab 163,840).
#
#   BENCH_COMMIT=<commit> bash gpu/device.sh bash gpu/jobs/topk.sh
#
# TOPK_TESTS=0 skips the tests; TOPK_SPLITS=0 the split-count sweep; TOPK_ARGS replaces the
# benchmark's shapes (e.g. a phase-only look:
#   TOPK_TESTS=0 TOPK_ARGS="--batch-sizes 1 64 --ks 8 64" bash gpu/device.sh bash gpu/jobs/topk.sh).
# KERNEL_TESTS=1 then runs every GPU kernel test (gpu/jobs/kernel_tests.sh; $OUT/gpu_kernel_tests.log)
# while the precompile finishes, so a session's first call also warms Triton's cache and
# suite.sh can run with KERNEL_TESTS_S=0.
# PRECOMPILE_K26=1 compiles the K2.6 rank's Marlin MoE kernels beside it (two CPU cores of
# sixteen; the GPU timings replay CUDA graphs, which the host barely touches) and waits for
# them, so a session's first call warms the cache the K2.6 calls need (~6 minutes cold).
# $OUT: topk_tests.log, topk_kernels_h200.{json,md}, splits/topk_kernels_h200.{json,md}
# (gpu_kernel_tests.log): with the two caches 8 files, all a call brings back.
set -o pipefail
source gpu/jobs/precompile_k26.sh
source gpu/jobs/kernel_tests.sh
[ "${PRECOMPILE_K26:-0}" = 1 ] && precompile_k26 500
if [ "${TOPK_TESTS:-1}" != 0 ]; then
  # 300 s: on a cold CuPy cache with the Marlin precompile beside it, 150 s cut the tests after
  # 20 of 23 (de3b5e0); a cut run is named as such (its summary counts only what ran)
  timed_tests "${TOPK_TESTS_S:-300}" "$OUT/topk_tests.log" -p no:cacheprovider -m gpu tests/test_kernels_gpu.py -k topk
  tail -2 "$OUT/topk_tests.log"
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_cuda_compile.py >> "$OUT/topk_tests.log" 2>&1  # nvcc: spills
  tail -1 "$OUT/topk_tests.log"
fi
timeout 240 python -m lab.bench.tree_kernels --topk-only ${TOPK_ARGS:---batch-sizes 1 8 32 64 --ks 8 16 32 64} \
  --phases --out "$OUT" 2>&1 | tee /tmp/topk.log | tail -30
# The split count swept at bs 1 and 64 (the automatic 16 for k >= 16 and 32 below came from a
# 16-vs-32 run at bs 1; at bs 64 the one-wave rule gives 1, which the 5ba7f73 sweep measured
# fastest at every k): $OUT/splits/topk_kernels_h200.{json,md}
[ "${TOPK_SPLITS:-1}" != 0 ] && timeout 150 python -m lab.bench.tree_kernels --topk-only \
  --batch-sizes 1 64 --ks 8 16 32 64 --splits 0 1 2 8 12 16 24 32 --out "$OUT/splits" 2>&1 | tail -40
source gpu/jobs/kernel_tests.sh
[ "${KERNEL_TESTS:-0}" = 1 ] && kernel_tests 330 "$OUT/gpu_kernel_tests.log"  # after the timings
wait
cat /tmp/precompile_k26.log 2>/dev/null
exit 0
