#!/usr/bin/env bash
# GPU job: one Kimi K2.6 TP-8 rank (61 layers, INT4 Marlin experts, dummy weights) served on one
# H200: plain vs chain vs DDTREE budgets 32/16/64/8, replay drafter with two acceptance profiles
# (dflash-k25-code; pycode-4l-ranks, the trained pair's measured rank histogram), 96- and
# 4096-token prompts, concurrency 1/8/32/4/16/2 (that order: the first levels are the ones
# that must finish). Hard deadline 480 s inside the job (a cell started before it can run for
# tens of seconds at 4096-token prompts; the job stops at 540).
# Run through the device command (one call, <= 9 min):
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse HEAD) bash gpu/jobs/k26_rank.sh
# Arms run one at a time (the rank is ~80 GB). Expected per server start: dummy init + Marlin
# repack of 60 MoE layers ~20-40 s, CUDA-graph capture up to bs 16 ~30-60 s, the Marlin MoE JIT
# kernel from the carried cache (290 s if it is missing: then only plain finishes). So one call
# fits plain + 3-4 speculative arms; ARMS=... runs the rest in a second call.
# LAYERS=N builds a short rank (a quick check that the shapes serve). JOB_S bounds the benchmark.
# GRAPH_MAX_BS (default 32: every level on CUDA graphs; at 16 the c=32 level ran eager in every
# arm, launch-bound), REPEATS timed passes per cell (default 2; the spread is reported).
# K26_AB_ARGS: more k26_ab flags; they come last, so they override the ones above.
set -o pipefail
LABEL="${LABEL:-k26_rank_ab_h200}"
MODEL="${K26_MODEL_DIR:-/tmp/k26-rank}"
python -m lab.models.k26_rank --out "$MODEL" --layers "${LAYERS:-61}" || exit 2
timeout "${JOB_S:-540}" python -m lab.bench.k26_ab --model "$MODEL/target" --drafter "$MODEL/drafter" \
  --out "$OUT" --label "$LABEL" --deadline-s "${DEADLINE_S:-480}" \
  --arms "${ARMS:-plain,chain,ddtree@32,ddtree@16,ddtree@64,ddtree@8}" \
  --profiles dflash-k25-code,pycode-4l-ranks --prompt-lens 96 4096 --concurrency 1 8 32 4 16 2 \
  --graph-max-bs "${GRAPH_MAX_BS:-32}" --repeats "${REPEATS:-2}" ${K26_AB_ARGS:-}
rc=$?
rm -rf "$OUT/${LABEL}_work/traces"  # summarised into the JSON (--torch-profile-arms); too big to bring back
tar czf "$OUT/${LABEL}_logs.tar.gz" -C "$OUT" "${LABEL}_work" && rm -rf "$OUT/${LABEL}_work"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
head -80 "$OUT/$LABEL.md" 2>/dev/null
exit $rc
