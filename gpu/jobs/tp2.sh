#!/usr/bin/env bash
# GPU job for the two-GPU kind (nvidia-h200-x2): DDTREE served with --tp 2 on the trained pair,
# next to plain and stock DFLASH, in one call of under 9 minutes.
#
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse HEAD) bash gpu/jobs/tp2.sh
#
# 1. The serving suite at TP-2 (tests/gpu_server, GPU_SERVER_TP=2, one wave of five servers):
#    DDTREE float32 with CUDA graphs token-identical to plain float32 on 16 held-out prompts at
#    bs 1 and in batches of 16, 11 and 5, and after aborts; DDTREE and DFLASH bf16 margin-exact
#    against plain bf16; the DDTREE servers run SGLANG_DDTREE_CHECK_TP_TREES=1 (each round
#    both ranks compare their trees and accepted paths; a divergence kills the server) and
#    test_tp_ranks_build_the_same_trees reads from their logs that the check ran.
# 2. Beside it, the A/B tool at TP-2 (python -m sglang_ddtree.ab --server-args "--tp 2 ...", without
#    the check: it syncs every round): plain, stock DFLASH, DDTREE budgets 32 and 7 (the chain's
#    width), all four servers up at once (interleaved, 4 x --mem-fraction-static 0.08 beside the
#    suite's), each on its own NCCL port (servers that start together would otherwise draw theirs
#    from one range); c = 1 and 8, REPEATS passes each, and torch profiles (--profile) of DFLASH and
#    DDTREE@32 at c = 1 and 8, 10 steps each, with the all-reduce time per round. Its servers start
#    with the suite's and measure once the suite is done (--wait-file).
# Every step is bounded; whatever finished is written. $OUT: gpu_server_tp2.{json,log},
# pycode-4l_h200x2_tp2_ab.{json,md,png}, tp2_logs.tar.gz (the suite's and the A/B's server logs,
# nvidia-smi topology), and the device command's caches.
# Variables: SUITE_S (360), AB_S (465), TIME_LIMIT_S (425), REPEATS (3), AB_ARGS (more flags, last).
set -o pipefail
P=lab/models/pairs/pycode-4l
SERIES="pycode-4l_${DEVICE_NAME:-h200}x2_tp2_ab"
DONE=/tmp/ddtree-tp2-suite-done
LOGS="$OUT/tp2_logs"
RAW=/tmp/tp2_ab_raw
rm -rf "$DONE" "$RAW" && mkdir -p "$LOGS"
t0=$(date +%s)
say() { echo "[tp2 $(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi topo -m > "$LOGS/nvidia_smi_topo.txt" 2>&1
python -c "import torch; n = torch.cuda.device_count(); print('GPUs:', n); assert n >= 2, 'TP-2 needs 2 GPUs'" || exit 2

SUITE_ARMS=plain_fp32,ddtree_fp32_graphs,plain_bf16_graphs,ddtree_bf16_graphs,dflash_bf16_graphs
SUITE_TESTS="(ddtree_fp32_graphs and not page16) or bf16 or tree_kernels or tp_ranks"
( GPU_SERVER_TP=2 GPU_SERVER_ONE_WAVE=1 GPU_SERVER_ARMS=$SUITE_ARMS GPU_SERVER_NCCL_PORT_BASE=24100 \
    timeout -s INT -k 30 "${SUITE_S:-360}" python -m pytest -m gpu_server tests/gpu_server -k "$SUITE_TESTS" \
    -p no:cacheprovider -v -rA > "$OUT/gpu_server_tp2.log" 2>&1; touch "$DONE" ) &
COMMON="--tp 2 --attention-backend triton --sampling-backend pytorch --dtype bfloat16 --max-total-tokens 65536"
COMMON="$COMMON --mem-fraction-static 0.08 --max-running-requests 64 --cuda-graph-max-bs-decode 32"
timeout -s TERM "${AB_S:-465}" python -m sglang_ddtree.ab \
  --model "$P/target" --drafter "$P/drafter" --server-args "$COMMON" --arms plain,dflash,ddtree@32,ddtree@7 \
  --arm-args "plain=--nccl-port 24200" --arm-args "dflash=--nccl-port 24201" \
  --arm-args "ddtree@32=--nccl-port 24202" --arm-args "ddtree@7=--nccl-port 24203" \
  --schedule interleaved --concurrency 1,8 --num-prompts 8,16 --repeats "${REPEATS:-3}" \
  --profile dflash@1,dflash@8,ddtree@32@1,ddtree@32@8 --profile-steps 10 \
  --dataset custom --dataset-path "$P/heldout_prompts.json" --output-len 128 --range-ratio 0.5 \
  --check-prompts 4 --check-tokens 32 --start-timeout 330 --keep-going \
  --time-limit "${TIME_LIMIT_S:-425}" --wait-file "$DONE" \
  --label pycode-4l --device-name "${DEVICE_NAME:-h200}x2" --series "$SERIES" \
  --results-dir "$OUT" --raw-dir "$RAW" --no-index ${AB_ARGS:-}
say "A/B exited with $?"
wait
say "suite done"

[ -f "$OUT/gpu_server.json" ] && mv "$OUT/gpu_server.json" "$OUT/gpu_server_tp2.json"
[ -f "$OUT/gpu_server_logs.tar.gz" ] && mv "$OUT/gpu_server_logs.tar.gz" "$LOGS/"
[ -d "$RAW" ] && find "$RAW" -name '*.trace.json*' -delete && mv "$RAW" "$LOGS/ab_raw"
tar czf "$OUT/tp2_logs.tar.gz" -C "$OUT" tp2_logs && rm -rf "$LOGS"
grep -E "PASSED|FAILED|ERROR|passed|failed|skipped" "$OUT/gpu_server_tp2.log" | tail -20
head -60 "$OUT/$SERIES.md" 2>/dev/null
say "done"
exit 0
