# Sourced by the trained pair's GPU jobs (ab_pair.sh, trace_pair.sh): the flags every server of the
# pair gets, as the GPU suite serves it (bf16, triton attention, the pytorch sampler, CUDA graphs up
# to bs 64) with a memory share small enough for eight servers at once (8 x 0.08 of the H200).
PAIR_SERVER_ARGS="--attention-backend triton --sampling-backend pytorch --dtype bfloat16 --max-total-tokens 65536"
PAIR_SERVER_ARGS="$PAIR_SERVER_ARGS --mem-fraction-static 0.08 --max-running-requests 64 --cuda-graph-max-bs-decode 64"
