#!/usr/bin/env bash
# GPU job: two jobs side by side on a two-GPU machine (nvidia-h200-x2), one GPU each, so that
# one call does the work of two (a job that measures speed keeps its GPU to itself; the host's
# 32 cores are shared). Each job sees only its GPU (CUDA_VISIBLE_DEVICES) and writes into its
# own folder, its $OUT and GPU_RESULTS_DIR, which comes back as one archive $OUT/<name>.tar
# (a call brings back at most 8 files: two archives leave room for the compile caches), with the
# job's output in <name>/<name>.log. Run through the device command, e.g. the serving suite
# beside a K2.6-rank A/B call:
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse HEAD) bash gpu/jobs/two_gpus.sh \
#     suite "env KERNEL_TESTS_S=0 K26_WARM=0 bash gpu/jobs/suite.sh" \
#     k26_call3 "env WHAT=ab_call3 ARMS=plain,chain,ddtree@16,chain+again bash gpu/jobs/ab_k26.sh"
# Both jobs budget their time from the call's start (DEVICE_T0), as they do alone. Two jobs that
# write the same /tmp paths (two K2.6-rank calls: /tmp/k26-rank) must not be paired.
# Exit status: the first job's if it failed, else the second's. GPUS ("0 1") picks the devices.
set -u -m  # -m: each job in its own process group (stopped whole), in the call's session
if [ $# -ne 4 ] || [ "$1" = "$3" ]; then
  echo "usage: two_gpus.sh NAME_A 'COMMAND A' NAME_B 'COMMAND B' (two different names)" >&2
  exit 2
fi
read -r -a gpus <<< "${GPUS:-0 1}"
if [ -z "${GPUS:-}" ] && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then
  echo "two_gpus.sh: this machine has fewer than 2 GPUs (ask for nvidia-h200-x2)" >&2
  exit 2
fi
TOP="${OUT:?}"
run_on() {  # run_on GPU NAME COMMAND: the job in the background, its output in its folder
  local dir="$TOP/$2"
  mkdir -p "$dir"
  CUDA_VISIBLE_DEVICES="$1" OUT="$dir" GPU_RESULTS_DIR="$dir" bash -c "$3" > "$dir/$2.log" 2>&1 &
}
run_on "${gpus[0]}" "$1" "$2"; a=$!
run_on "${gpus[1]}" "$3" "$4"; b=$!
stop() { kill -TERM -- "-$a" "-$b" 2> /dev/null; }
trap 'stop; exit 143' TERM INT
trap stop EXIT
echo "[two_gpus] $1 on GPU ${gpus[0]} (pid $a), $3 on GPU ${gpus[1]} (pid $b)"
wait "$a"; rc_a=$?
wait "$b"; rc_b=$?
trap - EXIT
for name in "$1" "$3"; do
  echo "===== $name: the end of its output ($name.tar holds all of it) ====="
  tail -n "${TAIL_LINES:-60}" "$TOP/$name/$name.log"
  tar cf "$TOP/$name.tar" -C "$TOP" "$name" && rm -rf "${TOP:?}/$name"
done
echo "[two_gpus] $1 exited with $rc_a, $3 with $rc_b"
[ "$rc_a" != 0 ] && exit "$rc_a"
exit "$rc_b"
