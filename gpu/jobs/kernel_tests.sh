# Sourced by GPU jobs. `kernel_tests SECONDS LOG` runs every GPU kernel test (pytest marker
# `gpu`: tree kernels, top-k, the tree engine, the online widths, the drafter KV graphs, the MLA
# verify and drafter block attention kernels) into LOG and prints its last line. On a cold
# Triton cache they take ~4-5 minutes (compiles), warm ~3.
kernel_tests() {
  timeout "$1" python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py tests/test_tree_engine.py \
    tests/test_online_widths.py tests/test_draft_kv_graphs.py tests/test_mla_verify.py tests/test_draft_attention.py > "$2" 2>&1
  tail -1 "$2"
}

# `timed_tests SECONDS LOG PYTEST_ARGS...`: the tests PYTEST_ARGS select, verbose, appended to LOG
# under a time limit, then how many of the collected ones finished (unfinished_tests.py names
# the rest) appended to LOG and printed last: a run cut by its limit ends with a pytest summary
# of what did run, which reads like a whole suite.
timed_tests() {
  local seconds=$1 log=$2 collected
  shift 2
  collected=$(mktemp)
  python -m pytest "$@" --collect-only -q > "$collected" 2>&1
  timeout -k 60 "$seconds" python -m pytest "$@" -v -rA >> "$log" 2>&1  # -k: a teardown that hangs after TERM
  python "$(dirname "${BASH_SOURCE[0]}")/unfinished_tests.py" "$collected" "$log" >> "$log"
  rm -f "$collected"
  pack_server_logs
}

# `pack_server_logs`: the serving suite's server logs as its teardown packs them
# ($GPU_RESULTS_DIR/gpu_server_logs.tar.gz), where a run killed before its teardown left them as
# files: a call brings back at most 8 files, and loose logs would crowd out the compile caches.
pack_server_logs() {
  local dir="${GPU_RESULTS_DIR:-${OUT:-/tmp/out}}"
  [ -d "$dir/gpu_server_logs" ] || return 0
  tar czf "$dir/gpu_server_logs.tar.gz" -C "$dir" gpu_server_logs && rm -rf "$dir/gpu_server_logs"
}
