#!/usr/bin/env bash
# Device command: unpack the GPU bundle and run one job on the H200, from the repository root.
#
#   bash gpu/device.sh <command ...>
#   bash gpu/device.sh python -m pytest -m gpu_server tests/gpu_server     # the GPU serving suite
#   bash gpu/device.sh python -m sglang_ddtree.ab ...                 # A/B runs
#
# Needs in the call's carry: .carry/gpu/site-<version>.tar.xz (from `make gpu-bundle`) and
# optionally the compile caches an earlier run wrote to $OUT: cache-<version>.tar.xz (JIT and
# CuPy), marlin-<version>.tar.xz (the K2.6 rank's Marlin MoE kernels: only its jobs need them)
# and triton-<version>.tar.xz. The working tree and the carry share the 64 MiB a call may carry,
# so a call names the files it needs (docs/gpu.md, "What a call carries"). The plugin runs from
# the working tree. Writes $OUT/cache-<version>.tar.xz, $OUT/marlin-<version>.tar.xz (only when
# the call built Marlin kernels it did not carry) and, where it fits,
# $OUT/triton-<version>.tar.xz at the end: `bash gpu/take_caches.sh <files_at>` takes them
# into .carry/gpu so the next call skips those compiles.
# Multi-GPU kinds: NVLink multicast stays off (the device's rule), whatever the job starts.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/out}"
V="${SGLANG_VERSION:-0.5.23}"
B=.carry/gpu
SITE="${DEVICE_SITE_DIR:-/tmp/ddtree-site-$V}"  # the overrides are for tests
CACHE="${DEVICE_CACHE_DIR:-/tmp/ddtree-cache}"
t0=$(date +%s)
export DEVICE_T0="$t0"  # jobs budget their steps from the call's start
say() { echo "[device $(( $(date +%s) - t0 ))s] $*"; }
mkdir -p "$OUT" "$CACHE"
untar_xz() {  # untar_xz FILE DIR (python's lzma where the image has no xz)
  if command -v xz > /dev/null; then tar xJf "$1" -C "$2"
  else python3 -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:xz').extractall(sys.argv[2])" "$1" "$2"; fi
}

stamp="$(cksum < "$B/site-$V.tar.xz" | cut -d' ' -f1)"
if [ "$(cat "$SITE/.stamp" 2>/dev/null)" != "$stamp" ]; then  # a warm machine keeps /tmp
  rm -rf "$SITE" && mkdir -p "$SITE" && untar_xz "$B/site-$V.tar.xz" "$SITE" || exit 3
  echo "$stamp" > "$SITE/.stamp"
  say "bundle unpacked"
fi
for name in cache marlin triton; do  # each once per machine (a warm one keeps /tmp)
  f="$B/$name-$V.tar.xz"
  if [ -f "$f" ] && [ ! -f "$CACHE/.restored-$name" ]; then
    untar_xz "$f" "$CACHE" && touch "$CACHE/.restored-$name" && say "$name cache restored: $(du -sh "$CACHE" | cut -f1)"
  fi
done

export PYTHONPATH="$SITE:$ROOT" PYTHONUNBUFFERED=1 CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" \
  SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 SGLANG_IS_FLASHINFER_AVAILABLE=false \
  SGLANG_DDTREE_TEST_PLUGIN="lab.gpu_compat${SGLANG_DDTREE_TEST_PLUGIN:+,$SGLANG_DDTREE_TEST_PLUGIN}" \
  SGLANG_JIT_CACHE_DIR="$CACHE/jit" TRITON_CACHE_DIR="$CACHE/triton" CUPY_CACHE_DIR="$CACHE/cupy" \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  GPU_RESULTS_DIR="$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
# The device part of the series names the jobs write (h200, h100, ...): the GPU this call got,
# which need not be the kind asked for.
export DEVICE_NAME="${DEVICE_NAME:-$(python -c 'from sglang_ddtree.ab.stamp import device_name; print(device_name(False))' 2>/dev/null)}"
"$@"
rc=$?
say "job exited with $rc"
source "$ROOT/gpu/xz.sh" || exit 3  # xz_pipe: the caches compressed for the way back
# A call brings back at most 8 files of at most 16 MiB each. The JIT's and CuPy's caches (the
# Marlin kernels: minutes of nvcc) go into cache-$V.tar.xz; Triton's (on the K2.6 rank about
# 20 s of an online-budget server's start went to widths whose graphs the carried Triton cache
# lacked: 22 and 18 s against 10 for the others) into triton-$V.tar.xz when that fits: at most
# 16 MiB and a file to spare among the 8.
MAX_BYTES=$(( 16 * 1024 * 1024 ))
MARLIN='./jit/*/sgl_kernel_jit_moe_wna16_marlin_*'
( cd "$CACHE" && tar cf - --exclude='.restored*' --exclude=./triton --exclude="$MARLIN" . | xz_pipe > "$OUT/cache-$V.tar.xz" )
say "caches saved: $(du -h "$OUT/cache-$V.tar.xz" | cut -f1)"
marlin=$(cd "$CACHE" && compgen -G "$MARLIN" || true)
if [ -n "$marlin" ] && [ ! -f "$B/marlin-$V.tar.xz" ]; then  # built here: the kernels never change
  if [ "$(find "$OUT" -type f | wc -l)" -ge 8 ]; then
    say "Marlin's kernels not saved: the job's files and the JIT cache fill the 8 a call brings back"
  else
    ( cd "$CACHE" && tar cf - $marlin | xz_pipe > "$OUT/marlin-$V.tar.xz" )
    say "Marlin's kernels saved: $(du -h "$OUT/marlin-$V.tar.xz" | cut -f1)"
  fi
fi
if [ -d "$CACHE/triton" ]; then
  if [ "$(find "$OUT" -type f | wc -l)" -ge 8 ]; then
    say "Triton's cache not saved: the job's files and the caches fill the 8 a call brings back"
  else
    ( cd "$CACHE" && tar cf - ./triton | xz_pipe > "$OUT/triton-$V.tar.xz" )
    if [ "$(stat -c %s "$OUT/triton-$V.tar.xz")" -gt "$MAX_BYTES" ]; then
      say "Triton's cache not saved: over 16 MiB ($(du -h "$OUT/triton-$V.tar.xz" | cut -f1))"
      rm -f "$OUT/triton-$V.tar.xz"
    else
      say "Triton's cache saved: $(du -h "$OUT/triton-$V.tar.xz" | cut -f1)"
    fi
  fi
fi
exit $rc
