# Sourced by GPU jobs: `precompile_k26 SECONDS` starts gpu/jobs/precompile_k26.py in the
# background (the K2.6 rank's Marlin MoE kernels, ~5-6 minutes of nvcc each on a cold cache,
# one CPU core apiece) with its log in /tmp/precompile_k26.log (not $OUT: a call brings back
# at most 8 files, and the jobs print this log's end); the job `wait`s for it before
# gpu/device.sh saves the caches. A staging folder left by a compile a timeout killed is
# dropped first (it is never reused).
precompile_k26() {
  find "${SGLANG_JIT_CACHE_DIR:-/nonexistent}" -maxdepth 3 -name ".staging-*" -exec rm -rf {} + 2>/dev/null
  timeout "$1" python gpu/jobs/precompile_k26.py > /tmp/precompile_k26.log 2>&1 &
}
