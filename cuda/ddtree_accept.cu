// DDTree accept walk kernel, an exact mirror of sglang_ddtree/tree/accept.py
// (accept_walk_ref).

#include "ddtree_common.cuh"

// One warp per request: walk from the root while posterior[cur] is the token of a child
// of cur (the child with the smallest slot, as the reference scans), then the bonus token.
// First, in parallel over slots, every node c whose token is its parent's posterior offers
// itself as that parent's chosen child (shared atomicMin keeps the smallest slot); then the
// walk is a pointer chase through the chosen children.
// With `sources`, it also writes the commit plan of accept.py::commit_sources_ref (the verify
// slot whose KV each final position keeps), and with `commit_lens` the tokens emitted
// (accept length + 1) as int32, the form SGLang's scheduler takes.
// Dynamic shared memory: 36 * W bytes.
extern "C" __global__ void __launch_bounds__(32)
    ddtree_accept_walk(const ddt_i64* __restrict__ tokens,       // [bs, W]
                       const ddt_i64* __restrict__ parents,      // [bs, W]
                       const ddt_i64* __restrict__ tree_sizes,   // [bs]
                       const ddt_i64* __restrict__ posterior,    // [bs, W]
                       const ddt_i64* __restrict__ prefix_lens,  // [bs] or null
                       ddt_i64 W_,
                       ddt_i64* __restrict__ path,          // [bs, W]
                       ddt_i64* __restrict__ accept_lens,   // [bs]
                       ddt_i64* __restrict__ bonus,         // [bs]
                       ddt_i64* __restrict__ out_tokens,    // [bs, W]
                       ddt_i64* __restrict__ new_seq_lens,  // [bs] or null
                       ddt_i64* __restrict__ sources,       // [bs, W] or null
                       int* __restrict__ commit_lens)       // [bs] or null
{
  const int W = (int)W_;
  const int b = blockIdx.x, lane = threadIdx.x;
  DDT_EXTERN_SMEM(smem_accept);
  ddt_i64* s_tok = reinterpret_cast<ddt_i64*>(smem_accept);
  ddt_i64* s_post = s_tok + W;
  ddt_i64* s_out = s_post + W;
  int* s_par = reinterpret_cast<int*>(s_out + W);
  int* s_path = s_par + W;
  int* s_child = s_path + W;  // smallest matching child slot, W = none
  __shared__ int s_depth;

  const ddt_i64 row = (ddt_i64)b * W;
  const ddt_i64 size64 = tree_sizes[b];
  const int size = (int)(size64 < 1 ? 1 : (size64 > W ? W : size64));
  for (int i = lane; i < W; i += 32) {
    s_post[i] = posterior[row + i];
    s_child[i] = W;
    if (i < size) {
      s_tok[i] = tokens[row + i];
      s_par[i] = (int)parents[row + i];
    }
  }
  __syncwarp();
  for (int c = 1 + lane; c < size; c += 32) {
    const int p = s_par[c];
    if (p >= 0 && p < c && s_tok[c] == s_post[p]) atomicMin(&s_child[p], c);
  }
  __syncwarp();
  if (lane == 0) {
    int cur = 0, depth = 0;
    for (int child = s_child[0]; child < W; child = s_child[cur]) {
      s_out[depth] = s_post[cur];
      ++depth;
      s_path[depth] = child;
      cur = child;
    }
    s_depth = depth;
    s_path[0] = cur;  // the last accepted slot (path[0] is written as 0 below)
  }
  __syncwarp();
  const int depth = s_depth;
  const ddt_i64 bonus_tok = s_post[s_path[0]];
  for (int i = lane; i < W; i += 32) {
    path[row + i] = (i == 0) ? 0 : (i <= depth ? (ddt_i64)s_path[i] : -1);
    out_tokens[row + i] = (i < depth) ? s_out[i] : (i == depth ? bonus_tok : 0);
    if (sources) sources[row + i] = (i == 0) ? 0 : (i <= depth ? (ddt_i64)s_path[i] : (ddt_i64)i);
  }
  if (lane == 0) {
    accept_lens[b] = depth;
    bonus[b] = bonus_tok;
    if (new_seq_lens) new_seq_lens[b] = (prefix_lens ? prefix_lens[b] : 0) + depth + 1;
    if (commit_lens) commit_lens[b] = depth + 1;
  }
}
