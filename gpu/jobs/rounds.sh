#!/usr/bin/env bash
# GPU job: the bf16 margin-aware part of the serving suite, and the round benchmark
# (plain, stock DFLASH, DDTREE at budgets 7/16/32/64) with per-round profiles. The two
# share the start-up; the benchmark measures once the suite's servers are gone.
# Run through the device command: bash gpu/device.sh bash gpu/jobs/rounds.sh
set -o pipefail
LABEL=gpu_rounds_pycode-4l_h200
DONE=/tmp/ddtree-margin-done
rm -f "$DONE"
( GPU_SERVER_ARMS=plain_bf16_graphs,ddtree_bf16_graphs,dflash_bf16_graphs \
    timeout 300 python -m pytest -m gpu_server tests/gpu_server -k bf16 -p no:cacheprovider -v -rA \
    > "$OUT/gpu_server_bf16.log" 2>&1; touch "$DONE" ) &
timeout "${ROUNDS_S:-520}" python -m sglang_ddtree.bench.gpu_rounds --out "$OUT" --label "$LABEL" \
  --arms plain,dflash,ddtree@7,ddtree@16,ddtree@32,ddtree@64 --deadline-s "${ROUNDS_DEADLINE_S:-470}" --wait-file "$DONE"
wait
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_server_bf16.log"
rm -rf "$OUT/${LABEL}_work/traces"  # summarised into the JSON; too big to bring back
tar czf "$OUT/${LABEL}_logs.tar.gz" -C "$OUT" "${LABEL}_work" && rm -rf "$OUT/${LABEL}_work"
cat "$OUT/$LABEL.md" 2>/dev/null | head -60
exit 0
