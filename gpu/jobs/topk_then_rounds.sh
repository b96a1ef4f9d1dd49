#!/usr/bin/env bash
# GPU job: the draft top-k call (topk.sh: its GPU tests and timings) and then the trained pair's
# round benchmark (rounds.sh) on one machine start; the top-k files are packed into
# $OUT/topk_results.tar.gz so that both jobs' files and the two caches fit the 8 a call brings back.
#   BENCH_COMMIT=<c> TOPK_SPLITS=0 TOPK_ARGS="..." ARMS=... bash gpu/device.sh bash gpu/jobs/topk_then_rounds.sh
bash gpu/jobs/topk.sh
( cd "$OUT" && tar czf topk_results.tar.gz topk_tests.log topk_kernels_h200.* 2>/dev/null \
  && rm -f topk_tests.log topk_kernels_h200.* )
bash gpu/jobs/rounds.sh
