#!/usr/bin/env bash
# GPU job: the whole GPU serving suite on an 80 GB card (an H100), in two halves of servers that
# each fit. All fifteen servers at --mem-fraction-static 0.05 leave the last ones no memory
# there (the H200 starts them together: suite.sh). Each half starts only its arms
# (GPU_SERVER_ARMS); a test whose arms are all in the other half skips, so every test runs in
# one half or both (a test over the started graph arms runs in each).
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse --short HEAD) bash gpu/jobs/suite_halves.sh
# $OUT/half_a/, $OUT/half_b/: gpu_tests.log, gpu_server.json, gpu_server_logs.tar.gz.
# HALF_S (250): each half's limit in seconds. HALVES (a,b): the halves this call runs. On an H100
# host half a's ten servers took ~3.5 minutes to start in two waves, so one call holds one half:
# HALVES=a HALF_S=390 with GPU_SERVER_ONE_WAVE=1 (the carried caches hold the kernels), then HALVES=b.
# HALVES=auto: the whole suite at once where the card holds it (over 100 GiB: suite.sh with the
# call's own settings), else half a (the call that follows runs HALVES=b).
set -o pipefail
HALVES="${HALVES:-a,b}"
if [ "$HALVES" = auto ]; then
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${mib:-0}" -gt 102400 ]; then
    echo "[suite_halves] ${mib} MiB: the whole suite at once"
    exec env KERNEL_TESTS_S=0 K26_WARM=0 SUITE_S="${WHOLE_S:-340}" bash gpu/jobs/suite.sh
  fi
  HALVES=a
fi
HALF_A=plain_fp32,plain_fp32_page16_chunked,plain_fp32_sync,ddtree_fp32_graphs,ddtree_fp32_graphs_page16_no_overlap_chunked,ddtree_fp32_eager,ddtree_fp32_graphs_eager_kv,plain_bf16_graphs,ddtree_bf16_graphs,dflash_bf16_graphs
HALF_B=plain_fp32,ddtree_fp32_eager_auto,ddtree_fp32_graphs_auto,ddtree_fp32_graphs_auto_width1,ddtree_fp32_graphs_auto_width1_eager_kv,ddtree_fp32_graphs_neox,ddtree_fp32_graphs_neox_eager_kv
python - "$HALF_A" "$HALF_B" <<'PY' || exit 2
import sys
from tests.gpu_server.arms import ARMS
halves = [set(h.split(",")) for h in sys.argv[1:]]
missing = set(ARMS) - halves[0] - halves[1]
assert not missing, f"arms in neither half: {sorted(missing)}"
PY
for half in ${HALVES//,/ }; do
  arms=$HALF_A; [ "$half" = b ] && arms=$HALF_B
  dir="$OUT/half_$half"
  mkdir -p "$dir"
  echo "[suite_halves] half $half: $arms"
  env OUT="$dir" GPU_RESULTS_DIR="$dir" GPU_SERVER_ARMS="$arms" KERNEL_TESTS_S=0 K26_WARM=0 \
    SUITE_S="${HALF_S:-250}" bash gpu/jobs/suite.sh
done
