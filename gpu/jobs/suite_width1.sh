#!/usr/bin/env bash
# GPU job: the whole GPU serving suite, then the width-1 step against plain with what is left
# of the call (issue 48's final check in one call).
#  1. gpu/jobs/suite.sh without the kernel tests and the K2.6 warm-up (KERNEL_TESTS_S=0
#     K26_WARM=0 unless set), its log in $OUT/gpu_tests.log;
#  2. gpu/jobs/ab_width1.sh, untimed (TIMED=0 PROFILE= unless set), at CONC (1,64), REPEATS (2),
#     when at least 200 s of JOB_S (575) are left.
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse --short HEAD) bash gpu/jobs/suite_width1.sh
set -o pipefail
env KERNEL_TESTS_S="${KERNEL_TESTS_S:-0}" K26_WARM="${K26_WARM:-0}" SUITE_S="${SUITE_S:-330}" \
  JOB_S="${JOB_S:-575}" bash gpu/jobs/suite.sh
env FIT_TO_CALL_S="${JOB_S:-575}" MIN_LEFT_S=200 TIMED="${TIMED:-0}" PROFILE="${PROFILE-}" CONC="${CONC:-1,64}" \
  PROMPTS="${PROMPTS:-8,128}" REPEATS="${REPEATS:-2}" bash gpu/jobs/ab_width1.sh
