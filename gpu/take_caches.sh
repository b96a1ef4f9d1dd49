#!/usr/bin/env bash
# Take the compile caches a device call brought back (cache-<v>.tar.xz: SGLang's JIT kernels and
# CuPy's; marlin-<v>.tar.xz: the K2.6 rank's Marlin kernels; triton-<v>.tar.xz) into .carry/gpu, recompressed with xz -9e (the device writes -6 to
# spare its time: 9.8 + 5.7 MB became 7.4 + 2.7), and print what the next call carries against
# the 64 MiB a call may carry (the working tree's files count too: a call over it is refused).
#   bash gpu/take_caches.sh /work/.device/N        # the call's files_at
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SRC="${1:?usage: take_caches.sh FILES_AT}"
V="${SGLANG_VERSION:-0.5.23}"
B="${CARRY_DIR:-$ROOT/.carry/gpu}"  # the override is for tests
mkdir -p "$B"
entries() { tar tJf "$1" 2>/dev/null | grep -vc '/$' || true; }  # files in a cache file (0: none)
for name in cache marlin triton; do
  f="$SRC/$name-$V.tar.xz"
  [ -f "$f" ] || continue
  # A call that did not carry a cache saves only what it compiled itself (a K2.6 rank call, which
  # carries no Triton cache, brings back the few Triton kernels of the rank): it would replace
  # the carried file with a smaller one, so a file with fewer entries than the carried one is left.
  brought=$(entries "$f") carried=$(entries "$B/$name-$V.tar.xz")
  if [ "$brought" -lt "$carried" ]; then
    echo "$name: kept the carried file ($carried entries; the call's had $brought)"
    continue
  fi
  stage="$(mktemp -d)"
  tar xJf "$f" -C "$stage"
  (cd "$stage" && tar cf - .) | xz -T0 -9e > "$B/$name-$V.tar.xz.new"
  mv "$B/$name-$V.tar.xz.new" "$B/$name-$V.tar.xz"
  rm -rf "$stage"
  echo "$name: $(du -h "$f" | cut -f1) -> $(du -h "$B/$name-$V.tar.xz" | cut -f1)"
done
size() { [ -f "$B/$1-$V.tar.xz" ] && stat -c %s "$B/$1-$V.tar.xz" || echo 0; }
tree=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
limit=$(( 64 * 1024 * 1024 ))
base=$(( tree + $(size site) + $(size cache) ))
pair=$(( base + $(size triton) ))  # the trained pair's and the kernels' calls
rank=$(( base + $(size marlin) ))  # the K2.6 rank's calls (Triton's cache too where it fits)
echo "a call carries the working tree ($(( tree >> 20 )) MiB), site and cache, and then triton: $(( pair >> 20 )) of 64 MiB," \
  "or marlin: $(( rank >> 20 )) (docs/gpu.md, \"What a call carries\")"
if [ "$pair" -gt "$limit" ] || [ "$rank" -gt "$limit" ]; then
  echo "over the 64 MiB a call may carry: ignore or drop what the jobs do not need" >&2
  exit 1
fi
