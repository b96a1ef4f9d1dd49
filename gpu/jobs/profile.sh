#!/usr/bin/env bash
# GPU job: the GPU kernel tests, the whole serving suite (8 arms), and the round benchmark
# with per-phase host times and torch-profiler profiles of DDTREE and stock DFLASH at
# bs 1 / 8 / 32. The benchmark's servers start with the suite's (start-up is mostly
# compilation) and measure once the suite is done.
# Run through the device command: bash gpu/device.sh bash gpu/jobs/profile.sh
set -o pipefail
LABEL=${LABEL:-gpu_rounds_profile_pycode-4l_h200}
DONE=/tmp/ddtree-suite-done
rm -f "$DONE"
(
  timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py tests/test_tree_engine.py \
    > "$OUT/gpu_tests.log" 2>&1
  timeout 330 python -m pytest -m gpu_server tests/gpu_server -p no:cacheprovider -v -rA >> "$OUT/gpu_tests.log" 2>&1
  touch "$DONE"
) &
timeout "${ROUNDS_S:-540}" python -m sglang_ddtree.bench.gpu_rounds --out "$OUT" --label "$LABEL" \
  --arms "${ARMS:-plain,dflash,ddtree@7,ddtree@32}" --concurrency 1 8 32 --profile-bs 1 8 32 \
  --profile-arms dflash,ddtree@7 --phase-times 50 --profile-export-s 60 \
  --deadline-s "${ROUNDS_DEADLINE_S:-500}" --wait-file "$DONE"
wait
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log"
rm -rf "$OUT/${LABEL}_work/traces"  # summarised into the JSON; too big to bring back
tar czf "$OUT/${LABEL}_logs.tar.gz" -C "$OUT" "${LABEL}_work" && rm -rf "$OUT/${LABEL}_work"
cat "$OUT/$LABEL.md" 2>/dev/null | head -80
exit 0
