#!/usr/bin/env bash
# GPU job: an online-budget change checked and measured in one call (issue 48).
#  1. the GPU tests of the online widths (tests/test_online_widths.py, tests/test_budget_host_work.py:
#     the prediction's graph against the eager prediction, no host synchronisation), into
#     $OUT/budget_kernel_tests.log;
#  1b. the online budget's host time per step on this host with cold caches (lab.bench.online_budget_host);
#  2. the online budget's serving tests (gpu/jobs/width1_check.sh's arms: float32 identity with
#     plain, eager and in per-width graphs, the width-1 decode check), cut at CHECK_S (240; 0:
#     skipped, where the whole suite runs in another call);
#  3. gpu/jobs/ab_pair.sh with what is left of the call (JOB_S, 570 s from its start): ARMS
#     (plain,ddtree@32,ddtree@auto64,ddtree@auto64+phases,plain+again) at CONC (1,32): the
#     online budget against the fixed tree and plain, and its phases (width choice, width record:
#     its own host work per round, docs/ab.md).
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse --short HEAD) bash gpu/jobs/budget_check.sh
set -o pipefail
python -m pytest -q -p no:cacheprovider -m gpu tests/test_online_widths.py tests/test_budget_host_work.py \
  > "$OUT/budget_kernel_tests.log" 2>&1
tail -3 "$OUT/budget_kernel_tests.log"
# the online budget's host time per step on this host, caches evicted between steps as a served
# round leaves them (lab/bench/online_budget_host.py --cold): ~30 s
timeout 90 python -m lab.bench.online_budget_host --budgets 64 --batch-sizes 1 8 --round-us 2500 --jitter 0.2 \
  --cold --out "$OUT" --name "online-budget_${DEVICE_NAME:-h200}_host_time_cold" > /dev/null \
  && tail -4 "$OUT/online-budget_${DEVICE_NAME:-h200}_host_time_cold.md"
export GPU_RESULTS_DIR="$OUT"
if [ "${CHECK_S:-240}" != 0 ]; then
  GPU_SERVER_ARMS=plain_fp32,ddtree_fp32_eager_auto,ddtree_fp32_graphs_auto,ddtree_fp32_graphs_auto_width1,ddtree_fp32_graphs_auto_width1_eager_kv \
    timeout "${CHECK_S:-240}" python -m pytest -m gpu_server tests/gpu_server -k "online_budget or width_ones" \
    -p no:cacheprovider -v -rA 2>&1 | tee "$OUT/online_budget.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
  source "$(dirname "$0")/kernel_tests.sh"
  pack_server_logs
  ( cd "$OUT" && tar cf online_budget_servers.tar gpu_server.json gpu_server_logs.tar.gz 2>/dev/null \
    && rm -f gpu_server.json gpu_server_logs.tar.gz )
fi
left=$(( ${JOB_S:-570} - ($(date +%s) - ${DEVICE_T0:-$(date +%s)}) ))
echo "[budget_check] ${left} s left of the call"
[ "$left" -lt 150 ] && exit 0
env ARMS="${ARMS:-plain,ddtree@32,ddtree@auto64,ddtree@auto64+phases,plain+again}" CONC="${CONC:-1,32}" \
  PROMPTS="${PROMPTS:-8,96}" REPEATS="${REPEATS:-3}" TIME_LIMIT_S=$(( left - 100 )) AB_S=$(( left - 25 )) \
  SERIES="${SERIES:-pycode-4l_${DEVICE_NAME:-h200}_budget_ab}" bash gpu/jobs/ab_pair.sh | tail -40
