#!/usr/bin/env bash
# GPU job (one H200, about 5 minutes): the tree-kernel and top-k benchmarks after their split
# into sweep / inputs / report modules. The quick sweep checks every configuration against the
# reference before timing it (a mismatch stops it), so a run that writes its report shows the
# split kept the benchmark whole; the times can be read against results/kimi-k2.6_h200_tree_kernels.md.
#
#   bash gpu/device.sh bash gpu/jobs/bench_split.sh
#
# $OUT: tree_kernels_h200_quick.{json,md,png}, topk_kernels_h200.{json,md}, bench_split.log.
set -o pipefail
{
  timeout 300 python -m lab.bench.tree_kernels --quick --out "$OUT"
  echo "tree_kernels exited with $?"
  timeout 120 python -m lab.bench.tree_kernels --topk-only --batch-sizes 1 64 --ks 16 64 --out "$OUT"
  echo "topk_kernels exited with $?"
} 2>&1 | tee "$OUT/bench_split.log" | tail -40
exit 0
