#!/usr/bin/env bash
# Build the GPU bundle: SGLang 0.5.23 for the lent H200 (python 3.12, torch 2.11 + CUDA 13,
# no network), written to .carry/gpu/site-<version>.tar.xz. `make gpu-bundle` runs it.
#
# What goes in (one tarball, unpacked to /tmp/site on the device by gpu/device.sh):
#   * sglang 0.5.23 (the project's pin), pure Python, from the PyPI wheel, without
#     multimodal_gen/, test/ and the cp311 Rust extensions (they cannot load on 3.12 and the
#     serving path does not import them), with the bundle patches patches/*-gpu-bundle-*.patch;
#   * sgl_kernel: the Python files and sm90/common_ops.abi3.so of sglang-kernel 0.4.5 (the
#     newest build for torch 2.11 + CUDA 13; 0.5.23's own kernel wheel needs torch 2.14),
#     without FA3 (flash_ops, 1.1 GB), sm100 and FlashMLA;
#   * the cp312 wheels the device image lacks (gpu/deps-<version>.txt);
#   * gpu/shims (a stand-in for IPython.display, imported by sglang/utils.py);
#   * an entry-point record for the plugin (sglang.srt.plugins -> ddtree). The plugin itself
#     is not bundled: it travels as the working tree and is put on PYTHONPATH by gpu/device.sh.
# Wheels are cached in $GPU_WHEELS (default ~/.cache/sglang-ddtree/gpu-wheels); the first
# run downloads ~400 MB (sglang-kernel 0.4.5 is mostly FA3, which is dropped).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
KERNEL_VERSION="${KERNEL_VERSION:-0.4.5}"
WHEELS="${GPU_WHEELS:-$HOME/.cache/sglang-ddtree/gpu-wheels}"
OUT_DIR="${OUT_DIR:-$ROOT/.carry/gpu}"
STAGE="$(mktemp -d "${TMPDIR:-/tmp}/ddtree-gpu-bundle.XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT
PY="${PY:-python3}"
SITE="$STAGE/site"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64
      --platform linux_x86_64 --platform any)
say() { echo "[gpu-bundle] $*" >&2; }
mkdir -p "$WHEELS" "$OUT_DIR" "$SITE"
t0=$(date +%s)

fetch() {  # fetch NAME==VERSION [pip download options]: into the wheel cache unless there
  local spec="$1"; shift
  local name="${spec%%==*}" version="${spec##*==}"
  local pattern; pattern="$(echo "$name" | tr 'A-Z-.' 'a-z__')_${version//-/_}_"
  if ! ls "$WHEELS" | tr 'A-Z-' 'a-z_' | grep -qF "$pattern"; then
    say "downloading $spec"
    "$PY" -m pip download -q --no-deps "$@" -d "$WHEELS" "$spec" 2>&1 | grep -v "is ignored" || true
  fi
  local w
  for w in "$WHEELS"/*.whl; do
    if [ "$(basename "$w" | tr 'A-Z-' 'a-z_' | cut -c1-${#pattern})" = "$pattern" ]; then echo "$w"; return; fi
  done
}

# 1. SGLang, pure Python, patched for the bundle.
SGL_WHEEL="$(fetch "sglang==$SGLANG_VERSION")"
[ -n "$SGL_WHEEL" ] || { say "no sglang $SGLANG_VERSION wheel"; exit 2; }
unzip -q "$SGL_WHEEL" -d "$STAGE/sglang-wheel"
( cd "$STAGE/sglang-wheel" && tar cf - --exclude='sglang/multimodal_gen' --exclude='sglang/test' \
    --exclude='*.so' --exclude='__pycache__' sglang "sglang-$SGLANG_VERSION.dist-info" ) | tar xf - -C "$SITE"
for p in "$ROOT"/patches/*-gpu-bundle-*.patch; do
  patch -s -p1 -d "$SITE" --dry-run < "$p" > /dev/null || { say "patch $(basename "$p") does not apply"; exit 2; }
  patch -s -p1 -d "$SITE" < "$p"
  say "applied $(basename "$p")"
done

# 2. sgl_kernel: Python files + the sm90 ops library only.
K_WHEEL="$(fetch "sglang-kernel==$KERNEL_VERSION" "${PLAT[@]}")"
[ -n "$K_WHEEL" ] || { say "no sglang-kernel $KERNEL_VERSION wheel"; exit 2; }
unzip -q "$K_WHEEL" -x 'sgl_kernel/flash_ops*' 'sgl_kernel/sm100/*' 'sgl_kernel/*flashmla*' \
  'sgl_kernel/spatial_ops*' -d "$STAGE/kernel-wheel" || true
cp -r "$STAGE/kernel-wheel/sgl_kernel" "$STAGE/kernel-wheel"/sglang_kernel-*.dist-info "$SITE/"
find "$SITE/sgl_kernel" -name '*.so' ! -path '*/sm90/common_ops.abi3.so' -delete

# 3. The cp312 dependencies the device image lacks.
grep -v '^\s*#' "$HERE/deps-$SGLANG_VERSION.txt" | sed -e 's/#.*//' -e 's/\s*$//' | grep -v '^$' > "$STAGE/deps.txt"
DEPS=()
while read -r spec; do
  case "$spec" in *==*) DEPS+=("$(fetch "$spec" "${PLAT[@]}")");;
    *) "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$STAGE/loose" "$spec" 2>&1 | grep -v "is ignored" || true;;
  esac
done < "$STAGE/deps.txt"
"$PY" -m pip install -q --no-deps --no-compile "${PLAT[@]}" --target "$SITE" "${DEPS[@]}" \
  $(ls "$STAGE"/loose/*.whl 2>/dev/null) 2>&1 | grep -v "is ignored" || true

# 4. Shims, and the plugin's entry point (the package comes from the working tree).
cp -r "$HERE/shims/." "$SITE/"
PLUGIN_VERSION="$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -1)"
DIST="$SITE/sglang_ddtree-$PLUGIN_VERSION.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: sglang-ddtree\nVersion: %s\n' "$PLUGIN_VERSION" > "$DIST/METADATA"
printf '[sglang.srt.plugins]\nddtree = sglang_ddtree.plugin:register\n' > "$DIST/entry_points.txt"

find "$SITE" -name '__pycache__' -prune -exec rm -rf {} +
rm -rf "$SITE/bin"
# xz: a call carries at most 64 MiB (bundle + compile caches + the working tree); xz makes
# the bundle 29 MB where gzip makes it 37, and -9e 28.4 where -6 made 29.2.
rm -f "$OUT_DIR/site-$SGLANG_VERSION.tar.gz"
tar cf - -C "$SITE" . | xz -T0 -9e > "$OUT_DIR/site-$SGLANG_VERSION.tar.xz"
say "$(du -h "$OUT_DIR/site-$SGLANG_VERSION.tar.xz" | cut -f1) $OUT_DIR/site-$SGLANG_VERSION.tar.xz ($(du -sh "$SITE" | cut -f1) unpacked) in $(( $(date +%s) - t0 )) s"
