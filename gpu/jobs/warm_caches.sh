#!/usr/bin/env bash
# GPU job: a session's first call when the checkout carries no Triton cache. Starts the whole
# serving suite's fleet (every arm compiles its attention, tree and sampling kernels) and runs only
# its three sequential-identity tests (SUITE_K), so the call ends well inside its limit with few
# files: gpu_tests.log, gpu_server.json, gpu_server_logs.tar.gz, and the caches gpu/device.sh saves
# (cache-<version>.tar.xz, triton-<version>.tar.xz). Take them with
# `bash gpu/take_caches.sh <files_at>`; the next call (the whole suite) then starts warm.
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse --short HEAD) bash gpu/jobs/warm_caches.sh
# Without the cache the fleet's start took most of a 320 s window (lab/notes/2026-12-05.md).
set -o pipefail
env KERNEL_TESTS_S="${KERNEL_TESTS_S:-0}" K26_WARM="${K26_WARM:-0}" SUITE_K="${SUITE_K:-sequential}" \
  SUITE_S="${SUITE_S:-480}" JOB_S="${JOB_S:-540}" bash gpu/jobs/suite.sh
ls "$OUT"
