#!/usr/bin/env bash
# GPU job: the GPU kernel tests, the whole serving suite (8 arms), and the round benchmark:
# plain vs stock DFLASH vs DDTREE budgets, a +phases arm (host time per round phase) and
# torch-profiler profiles of DFLASH and DDTREE at bs 1 / 8 / 32. The benchmark's servers
# start with the suite's (start-up is mostly compilation) and measure once the suite is done;
# at --mem-fraction-static 0.04 they did not fit beside the suite. With sixteen servers up at
# once an arm may still fail to start: gpu_rounds records it and measures the others.
# SUITE=0 skips the suite (the benchmark then measures as soon as its servers are up).
# Run through the device command: bash gpu/device.sh bash gpu/jobs/profile.sh
set -o pipefail
LABEL=${LABEL:-gpu_rounds_profile_pycode-4l_h200}
DONE=/tmp/ddtree-suite-done
rm -f "$DONE"
# The kernel tests first and alone: beside sixteen starting servers they ran out of time.
timeout "${KERNEL_TESTS_S:-240}" python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py \
  tests/test_tree_engine.py > "$OUT/gpu_tests.log" 2>&1
tail -1 "$OUT/gpu_tests.log"
if [ "${SUITE:-1}" = 1 ]; then (
  timeout 330 python -m pytest -m gpu_server tests/gpu_server -p no:cacheprovider -v -rA > "$OUT/gpu_server.log" 2>&1
  touch "$DONE"
) & else touch "$DONE"; fi
timeout "${ROUNDS_S:-570}" python -m lab.bench.gpu_rounds --out "$OUT" --label "$LABEL" \
  --arms "${ARMS:-plain,dflash,ddtree@7,ddtree@7+eagerstep,ddtree@7+phases,ddtree@32,ddtree@16,ddtree@64}" \
  --concurrency ${CONC:-1 4 8 16 32} --profile-bs ${PROFILE_BS:-1 8 32} \
  --profile-arms dflash,ddtree@7 --phase-times 50 --profile-export-s 40 \
  --deadline-s "${ROUNDS_DEADLINE_S:-555}" --wait-file "$DONE"
wait
[ -f "$OUT/gpu_server.log" ] && cat "$OUT/gpu_server.log" >> "$OUT/gpu_tests.log" && rm "$OUT/gpu_server.log"
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log"
rm -rf "$OUT/${LABEL}_work/traces"  # summarised into the JSON; too big to bring back
tar czf "$OUT/${LABEL}_logs.tar.gz" -C "$OUT" "${LABEL}_work" && rm -rf "$OUT/${LABEL}_work"
cat "$OUT/$LABEL.md" 2>/dev/null | head -90
exit 0
