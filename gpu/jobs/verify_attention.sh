#!/usr/bin/env bash
# GPU job: tree-verify attention at K2.6-rank MLA shapes (8 heads): this project's split kernel
# beside SGLang's own target-verify path (extend_attention_fwd, which walks each request's
# prefix serially: one program per request, head and query tile), both checked against the
# float32 reference first. Why: the K2.6 rank's speculative rounds cost 71 ms at 4096-token
# prompts against 18 ms at 96 (bench_results/k26_rank_ab_4k_h200_e967973.md at the tag bench-results-archive).
# CONFIGS="M64N64w8s2 M32N64w4s2" times the prefix pass under each tile config in every row
# (budget 8, W 9 = 72 query rows at 8 heads: two tiles of 64 or three of 32, each reading the prefix).
# PRECOMPILE_K26=1 compiles the K2.6 rank's Marlin MoE kernels beside it (a session's first
# call: ~5-6 minutes of nvcc, 310-328 s at 54f535d; the timings replay on the GPU) and
# KERNEL_TESTS=1 runs the GPU kernel tests after the timings, while the compile finishes.
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse --short HEAD) bash gpu/jobs/verify_attention.sh
set -o pipefail
NAME=${NAME:-verify_attention_sglang_h200}
source gpu/jobs/precompile_k26.sh
source gpu/jobs/kernel_tests.sh
[ "${PRECOMPILE_K26:-0}" = 1 ] && precompile_k26 500
timeout "${JOB_S:-200}" python -m lab.bench.mla_tree_attention --out "$OUT" --name "$NAME" --sglang \
  --heads 8 --budgets ${BUDGETS:-7 8 16} --bs ${BS:-1 8 32} --prefix ${PREFIX:-96 4096 16384} \
  ${CONFIGS:+--configs $CONFIGS} \
  --drafter-shape 8 8 1 128  # the K2.6 DFlash drafter rank: block 8, 8 heads, 1 KV head, dim 128
rc=$?
head -60 "$OUT/$NAME.md" 2>/dev/null
[ "${KERNEL_TESTS:-0}" = 1 ] && kernel_tests 300 "$OUT/gpu_kernel_tests.log"
wait
tail -3 /tmp/precompile_k26.log 2>/dev/null
exit $rc
