#!/usr/bin/env bash
# GPU job: the online budget (--speculative-ddtree-budget auto, docs/online-budget.md), float32
# on the trained pair, against plain float32, on the eager GPU path (--disable-cuda-graph) and
# with CUDA graphs (a target verify graph set per width, adapter/width_graphs.py): token
# identity at bs 1 and in batches of 16, 11 and 5, and the widths each chose per batch size
# with its round costs (the stats line; under graphs also the start-up table), recorded in
# gpu_server.json. The arm ddtree_fp32_graphs_auto_width1 injects a cost table that makes
# every batched step width 1: those steps must run in width 1's verify graphs with no drafter
# replay (stats line: width1_steps_without_draft), and the tree must come back at bs 1.
#
#   bash gpu/device.sh bash gpu/jobs/online_budget.sh
#
# $OUT: online_budget.log, gpu_server.json, gpu_server_logs.tar.gz.
set -o pipefail
export GPU_RESULTS_DIR="$OUT" GPU_SERVER_ARMS=plain_fp32,ddtree_fp32_eager_auto,ddtree_fp32_graphs_auto,ddtree_fp32_graphs_auto_width1,ddtree_fp32_graphs_auto_width1_eager_kv
timeout 560 python -m pytest -m gpu_server tests/gpu_server -k "online_budget or width_ones" -p no:cacheprovider -v -rA 2>&1 \
  | tee "$OUT/online_budget.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|skipped"
exit 0
