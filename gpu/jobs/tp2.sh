#!/usr/bin/env bash
# GPU job for the two-GPU kind (nvidia-h200-x2): DDTREE served with --tp-size 2 on the trained
# pair, next to plain and stock DFLASH, in one call of under 9 minutes.
#
#   bash gpu/device.sh bash gpu/jobs/tp2.sh        (BENCH_COMMIT=$(git rev-parse HEAD) in front)
#
# 1. The serving suite at TP-2 (tests/gpu_server, GPU_SERVER_TP=2, one wave of five servers):
#    DDTREE float32 with CUDA graphs token-identical to plain float32 on 16 held-out prompts at
#    bs 1 and in batches of 16, 11 and 5, and after aborts; DDTREE and DFLASH bf16 margin-exact
#    against plain bf16; the DDTREE servers run SGLANG_DDTREE_CHECK_TP_TREES=1 (each round
#    both ranks compare their trees and accepted paths; a divergence kills the server) and
#    test_tp_ranks_build_the_same_trees reads from their logs that the check ran.
# 2. The round benchmark at TP-2 (gpu_rounds --tp 2, without the check: it syncs every round):
#    plain / DFLASH / DDTREE budgets 32 and 7 (the chain's width), concurrency 1 and 8, tok/s,
#    accept length, round time, and profiles of 10 decode rounds at bs 1 and 8 of DFLASH and
#    DDTREE with the all-reduce time.
#    Its servers start with the suite's and measure once the suite is done.
# Every step is bounded; whatever finished is written. $OUT: gpu_server_tp2.{json,log},
# <LABEL>.{json,md,png}, tp2_logs.tar.gz (every server log, nvidia-smi topology), and the
# device command's cache tarball.
set -o pipefail
LABEL=gpu_rounds_pycode-4l_h200x2_tp2
DONE=/tmp/ddtree-tp2-suite-done
LOGS="$OUT/tp2_logs"
rm -f "$DONE" && mkdir -p "$LOGS"
t0=$(date +%s)
say() { echo "[tp2 $(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi topo -m > "$LOGS/nvidia_smi_topo.txt" 2>&1
python -c "import torch; n = torch.cuda.device_count(); print('GPUs:', n); assert n >= 2, 'TP-2 needs 2 GPUs'" || exit 2

SUITE_ARMS=plain_fp32,ddtree_fp32_graphs,plain_bf16_graphs,ddtree_bf16_graphs,dflash_bf16_graphs
SUITE_TESTS="(ddtree_fp32_graphs and not page16) or bf16 or tree_kernels or tp_ranks"
( GPU_SERVER_TP=2 GPU_SERVER_ONE_WAVE=1 GPU_SERVER_ARMS=$SUITE_ARMS GPU_SERVER_NCCL_PORT_BASE=24100 \
    timeout -s INT -k 30 "${SUITE_S:-360}" python -m pytest -m gpu_server tests/gpu_server -k "$SUITE_TESTS" \
    -p no:cacheprovider -v -rA > "$OUT/gpu_server_tp2.log" 2>&1; touch "$DONE" ) &
timeout -s INT -k 30 "${ROUNDS_S:-465}" python -m lab.bench.gpu_rounds --tp 2 --nccl-port-base 24200 \
  --out "$OUT" --label "$LABEL" --arms plain,dflash,ddtree@32,ddtree@7 --concurrency 1 8 \
  --profile-arms dflash,ddtree@32 --profile-bs 1 8 --profile-steps 10 --profile-export-s 30 \
  --start-timeout 330 --deadline-s "${ROUNDS_DEADLINE_S:-425}" --wait-file "$DONE"
say "benchmark exited with $?"
wait
say "suite done"

[ -f "$OUT/gpu_server.json" ] && mv "$OUT/gpu_server.json" "$OUT/gpu_server_tp2.json"
if [ -f "$OUT/$LABEL.json" ] && [ ! -f "$OUT/$LABEL.md" ]; then  # interrupted: report what it measured
  python -c "import json, sys; from pathlib import Path; from lab.bench.gpu_rounds_report import write_report; write_report(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]), sys.argv[3])" \
    "$OUT/$LABEL.json" "$OUT" "$LABEL"
fi
[ -f "$OUT/gpu_server_logs.tar.gz" ] && mv "$OUT/gpu_server_logs.tar.gz" "$LOGS/"
rm -rf "$OUT/${LABEL}_work/traces"  # summarised into the JSON; too big to bring back
[ -d "$OUT/${LABEL}_work" ] && mv "$OUT/${LABEL}_work" "$LOGS/"
tar czf "$OUT/tp2_logs.tar.gz" -C "$OUT" tp2_logs && rm -rf "$LOGS"
grep -E "PASSED|FAILED|ERROR|passed|failed|skipped" "$OUT/gpu_server_tp2.log" | tail -20
head -40 "$OUT/$LABEL.md" 2>/dev/null
say "done"
exit 0
