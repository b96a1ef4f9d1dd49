#!/usr/bin/env bash
# GPU job: the serving suite, then the top-k kernel tests and benchmark (each bounded).
# Run through the device command: bash gpu/device.sh bash gpu/jobs/exactness.sh
set -o pipefail
timeout 380 python -m pytest -m gpu_server tests/gpu_server -p no:cacheprovider -v -rA 2>&1 | tee "$OUT/gpu_server.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
{
  timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py -k topk
  timeout "${TOPK_BENCH_S:-110}" python -m lab.bench.topk_kernels --ks 8 16 32 64 --splits 0 16 32 --out "$OUT"
} 2>&1 | tee "$OUT/topk.log" | tail -30
exit 0
