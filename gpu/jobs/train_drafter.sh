#!/usr/bin/env bash
# GPU job: a second drafter for the trained pair's target, more confident than the pair's own
# (python -m lab.models.train_drafter: 4 layers reading target layers 0, 1 and 2, trained on the
# target's greedy continuations), then its chain accept length estimated on the held-out prompts.
# The corpus is cut from the CPU machine's packages as the pair's was and encoded by the pair's
# tokenizer, prepared there and carried (the GPU machine's packages are other files):
#   python -m lab.models.train_drafter --pair lab/models/pairs/pycode-4l --name x --prepare-only --data /tmp/pair-data/full
#   mkdir -p .carry/pair && tar cJf .carry/pair/pair-data.tar.xz -C /tmp/pair-data full
#   bash gpu/device.sh env BENCH_COMMIT=$(git rev-parse HEAD) bash gpu/jobs/train_drafter.sh   # carry .carry/gpu/site-*, .carry/pair
# Writes $OUT/<NAME>.tar (the drafter folder lab/models/pairs/pycode-4l/<NAME>: config, weights,
# manifest with the estimate, train log): untar it into lab/models/pairs/pycode-4l and commit it;
# then DRAFTER=<NAME> gpu/jobs/trace_pair.sh records its trace, and on the CPU
# `python -m lab.bench.pair_eval --drafter <NAME>` measures its acceptance through real servers.
# Variables: NAME (drafter-d4), MINUTES (7: continuations and training), TRAIN_ARGS (more flags, e.g.
# --draft-layers 6 --target-layer-ids 0,1,2,3 --greedy-share 0.5), DATA (.carry/pair/pair-data.tar.xz),
# PRECOMPILE_K26=1 (the K2.6 rank's Marlin kernels built beside the training on the CPU cores the
# training leaves idle, so one call also warms the cache the K2.6 calls need; gpu/device.sh saves it).
set -o pipefail
if [ "${PRECOMPILE_K26:-0}" = 1 ]; then
  source "$(dirname "$0")/precompile_k26.sh"
  precompile_k26 "${PRECOMPILE_S:-500}"
fi
NAME="${NAME:-drafter-d4}"
P=lab/models/pairs/pycode-4l
D=/tmp/pair-data
if [ ! -f "$D/full/DONE.json" ]; then
  mkdir -p "$D" && tar xJf "${DATA:-.carry/pair/pair-data.tar.xz}" -C "$D" || exit 2
fi
python -m lab.models.train_drafter --pair "$P" --name "$NAME" --data "$D/full" --device cuda \
  --time-limit "${MINUTES:-7}" ${TRAIN_ARGS:-}
rc=$?
[ -d "$P/$NAME" ] && tar cf "$OUT/$NAME.tar" -C "$P" "$NAME"
wait && [ "${PRECOMPILE_K26:-0}" = 1 ] && tail -2 /tmp/precompile_k26.log
exit $rc
