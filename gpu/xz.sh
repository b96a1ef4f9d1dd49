# Sourced by gpu/device.sh and the jobs that pack what a call brings back.
# `xz_pipe`: stdin to stdout through xz, or Python's lzma where the image has no xz.
xz_pipe() {
  if command -v xz > /dev/null; then xz -T0 -6
  else python3 -c $'import lzma, shutil, sys\nwith lzma.open(sys.stdout.buffer, "wb") as out: shutil.copyfileobj(sys.stdin.buffer, out)'
  fi
}
