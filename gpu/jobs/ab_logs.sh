# Sourced by the A/B GPU jobs. `bring_back_logs RAW SERIES`: the run's server and load logs
# (the tool's --raw-dir) as $OUT/SERIES_logs.tar.gz, unless over the 16 MiB a call brings back.
# The torch traces of --profile stay behind (their summaries are in the series; too big).
bring_back_logs() {
  local raw=$1 series=$2
  [ -d "$raw" ] || return 0
  tar czf "$OUT/${series}_logs.tar.gz" --exclude='*.trace.json*' -C "$(dirname "$raw")" "$(basename "$raw")"
  if [ "$(stat -c %s "$OUT/${series}_logs.tar.gz")" -gt $((16 * 1024 * 1024)) ]; then
    echo "logs over 16 MiB: not brought back"; rm -f "$OUT/${series}_logs.tar.gz"
  fi
}
