#!/usr/bin/env bash
# GPU job: a width-1 change checked and measured in one call (issue 48's decoding step).
#  1. the online budget's serving tests (gpu/jobs/online_budget.sh's arms: plain float32, `auto`
#     eager, in per-width graphs, and with the injected table that makes every batched step a
#     decoding step in width 1's decode graphs, its hidden states checked against an eager
#     width-1 verify: tests/decode_check_plugin.py), cut at CHECK_S (300) seconds;
#  2. gpu/jobs/ab_width1.sh, the width-1-only server against plain and a second plain server,
#     without the timed arms or profiles unless asked (TIMED=0 PROFILE= by default here), at
#     CONC (1,64), with what is left of the call (AB_S: 570 s from the call's start less stage 1).
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse --short HEAD) bash gpu/jobs/width1_check.sh
# CHECK_ARMS and CHECK_K narrow stage 1 (e.g. CHECK_ARMS=plain_fp32,ddtree_fp32_graphs_auto_width1
# CHECK_K="online_budget and width1"); TIMED=1 STEP_PROFILE=1 PROFILE=plain@1,ddtree@auto64@1 give
# stage 2 the timed arms, their cProfile and the device profile (ab_width1.sh).
# $OUT: online_budget.log, online_budget_servers.tar (gpu_server.json, gpu_server_logs.tar.gz), the
# width-1 series and its logs (with the diagnostics of the timed arms: ab_width1.sh).
set -o pipefail
export GPU_RESULTS_DIR="$OUT"
GPU_SERVER_ARMS="${CHECK_ARMS:-plain_fp32,ddtree_fp32_eager_auto,ddtree_fp32_graphs_auto,ddtree_fp32_graphs_auto_width1,ddtree_fp32_graphs_auto_width1_eager_kv}" \
  timeout "${CHECK_S:-300}" python -m pytest -m gpu_server tests/gpu_server -k "${CHECK_K:-online_budget or width_ones}" -p no:cacheprovider -v -rA 2>&1 \
  | tee "$OUT/online_budget.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|skipped|decode_check"
# the run's record and server logs as one file (a call brings back 8: room for the Triton cache)
source "$(dirname "$0")/kernel_tests.sh"
pack_server_logs  # a run cut before its teardown left them loose
( cd "$OUT" && tar cf online_budget_servers.tar gpu_server.json gpu_server_logs.tar.gz 2>/dev/null \
  && rm -f gpu_server.json gpu_server_logs.tar.gz )
env FIT_TO_CALL_S="${JOB_S:-570}" TIMED="${TIMED:-0}" PROFILE="${PROFILE-}" CONC="${CONC:-1,64}" PROMPTS="${PROMPTS:-8,128}" \
  REPEATS="${REPEATS:-3}" bash gpu/jobs/ab_width1.sh
