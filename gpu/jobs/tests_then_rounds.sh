#!/usr/bin/env bash
# GPU job: the online budget's GPU tests, then the trained pair's round benchmark (rounds.sh), on
# one machine start:
#  1. tests/test_online_widths.py -m gpu (the step does not synchronise; its verify is timed on
#     the device, the rest of its period goes to the row);
#  2. the serving suite's online-budget cases with the arms SUITE_ARMS (default: plain and DDTREE
#     auto in float32 under CUDA graphs: greedy token identity with plain), one wave of servers;
#  3. the online budget's host time per step on this machine's host, CUDA tensors
#     (python -m lab.bench.online_budget_host; HOST_BENCH=0 leaves it out);
#  4. rounds.sh with the caller's ARMS / ROUNDS_S / ROUNDS_DEADLINE_S.
# The test and host-time files are packed into $OUT/online_budget_tests.tar.gz so that every
# part's files and the two caches fit the 8 a call brings back.
#   BENCH_COMMIT=<c> ARMS=... ROUNDS_S=330 ROUNDS_DEADLINE_S=310 bash gpu/device.sh bash gpu/jobs/tests_then_rounds.sh
set -o pipefail
timeout "${UNIT_TESTS_S:-120}" python -m pytest -q -p no:cacheprovider -m gpu tests/test_online_widths.py \
  > "$OUT/online_widths_tests.log" 2>&1
tail -1 "$OUT/online_widths_tests.log"
KERNEL_TESTS_S=0 K26_WARM=0 GPU_SERVER_ONE_WAVE=1 SUITE_K="${SUITE_K:-online_budget}" \
  GPU_SERVER_ARMS="${SUITE_ARMS:-plain_fp32,ddtree_fp32_graphs_auto}" SUITE_S="${SUITE_S:-200}" bash gpu/jobs/suite.sh
if [ "${HOST_BENCH:-1}" != 0 ]; then
  timeout "${HOST_BENCH_S:-120}" python -m lab.bench.online_budget_host --out "$OUT" > "$OUT/online_budget_host.log" 2>&1
  tail -9 "$OUT/online_budget_host.log"
fi
( cd "$OUT" && tar czf online_budget_tests.tar.gz online_widths_tests.log gpu_tests.log gpu_server.json \
  gpu_server_logs.tar.gz online_budget_host* 2>/dev/null
  rm -f online_widths_tests.log gpu_tests.log gpu_server.json gpu_server_logs.tar.gz online_budget_host* )
bash gpu/jobs/rounds.sh
