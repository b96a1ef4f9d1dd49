# Sourced by the A/B GPU jobs. `bring_back_logs RAW SERIES`: the run's server and load logs
# (the tool's --raw-dir) as $OUT/SERIES_logs.tar.xz, unless over the 16 MiB a call brings back.
# xz, not gzip: the servers' logs repeat one another beyond gzip's 32 KiB window, and the
# committed series' logs took a quarter of gzip's bytes (4.1 MB -> 1.0), room a call's carry
# needs. The torch traces of --profile stay behind (their summaries are in the series; too big).
bring_back_logs() {
  local raw=$1 series=$2
  local packed="$OUT/${series}_logs.tar.xz"
  [ -d "$raw" ] || return 0
  tar cf - --exclude='*.trace.json*' -C "$(dirname "$raw")" "$(basename "$raw")" | xz_pipe > "$packed"
  if [ "$(stat -c %s "$packed")" -gt $((16 * 1024 * 1024)) ]; then
    echo "logs over 16 MiB: not brought back"; rm -f "$packed"
  fi
}

source "$(dirname "${BASH_SOURCE[0]}")/../xz.sh"  # xz_pipe

# `write_diagnostics RAW SERIES`: the timers' lines and the profiles' tops (RAW/SERIES_*.pstats) in
# one file, RAW/diagnostics.txt, beside the logs: a call brings back 8 files, and the logs'
# tarball (which holds this file and the .pstats) is one of them.
write_diagnostics() {
  local raw=$1 series=$2 stats
  [ -d "$raw" ] || return 0
  {
    grep -h "STEP TIMER us/step\|STEP TIMER syncs/step\|DDTREE phase host us/round" "$raw"/*/*.log "$raw"/*.log 2>/dev/null
    for stats in "$raw/${series}"_*.pstats; do  # the functions that take a step's host time
      [ -f "$stats" ] || continue
      echo "== $stats"
      python -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(45)" "$stats" 2>&1 \
        | grep -v "^$" | cut -c1-160
      echo "== $stats: by own time"
      python -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(30)" "$stats" 2>&1 \
        | grep -v "^$" | cut -c1-160
    done
  } > "$raw/diagnostics.txt"
}
