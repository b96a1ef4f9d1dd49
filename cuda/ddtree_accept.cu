// DDTree accept walk and KV commit kernels, exact mirrors of
// sglang_ddtree/tree/accept.py (accept_walk_ref, rewrite_req_to_token_ref, move_kv_ref).

#include "ddtree_common.cuh"

// One warp per request: walk from the root while posterior[cur] is the token of a child
// of cur (the child with the smallest slot, as the reference scans), then the bonus token.
// First, in parallel over slots, every node c whose token is its parent's posterior offers
// itself as that parent's chosen child (shared atomicMin keeps the smallest slot); then the
// walk is a pointer chase through the chosen children.
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
                       ddt_i64* __restrict__ new_seq_lens)  // [bs] or null
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
  }
  if (lane == 0) {
    accept_lens[b] = depth;
    bonus[b] = bonus_tok;
    if (new_seq_lens) new_seq_lens[b] = (prefix_lens ? prefix_lens[b] : 0) + depth + 1;
  }
}

// Page size 1: swap req_to_token entries so that position prefix + d names the slot the
// accepted node path[d] was verified in, in the reference's order. One warp per request:
// the affected stretch of the row is staged in shared memory, the swaps run there, and the
// stretch is written back. Dynamic shared memory: 16 * W bytes.
template <typename T>
__device__ __forceinline__ void ddt_commit_table(T* __restrict__ table, ddt_i64 stride,
                                                 const ddt_i64* __restrict__ req_pool_indices,
                                                 const ddt_i64* __restrict__ prefix_lens,
                                                 const ddt_i64* __restrict__ path,
                                                 const ddt_i64* __restrict__ accept_lens, int W) {
  const int b = blockIdx.x, lane = threadIdx.x;
  ddt_i64 L64 = accept_lens[b];
  const int L = (int)(L64 < 0 ? 0 : (L64 > W - 1 ? W - 1 : L64));
  if (L == 0) return;
  DDT_EXTERN_SMEM(smem_commit);
  ddt_i64* s_seg = reinterpret_cast<ddt_i64*>(smem_commit);
  int* s_path = reinterpret_cast<int*>(s_seg + W);
  const ddt_i64 prow = (ddt_i64)b * W;
  for (int d = lane; d <= L; d += 32) s_path[d] = (int)path[prow + d];
  __syncwarp();
  const int hi = s_path[L];  // path is increasing: the last accepted slot is the largest
  T* r = table + req_pool_indices[b] * stride + prefix_lens[b];
  for (int i = lane; i <= hi; i += 32) s_seg[i] = (ddt_i64)r[i];
  __syncwarp();
  if (lane == 0) {
    for (int d = 1; d <= L; ++d) {
      const int src = s_path[d];
      if (src != d) {
        const ddt_i64 tmp = s_seg[src];
        s_seg[src] = s_seg[d];
        s_seg[d] = tmp;
      }
    }
  }
  __syncwarp();
  for (int i = lane; i <= hi; i += 32) r[i] = (T)s_seg[i];
}

#define DDT_COMMIT_TABLE(NAME, T)                                                                    \
  extern "C" __global__ void __launch_bounds__(32)                                                   \
      NAME(T* table, ddt_i64 stride, const ddt_i64* req_pool_indices, const ddt_i64* prefix_lens,   \
           const ddt_i64* path, const ddt_i64* accept_lens, ddt_i64 W) {                            \
    ddt_commit_table<T>(table, stride, req_pool_indices, prefix_lens, path, accept_lens, (int)W);   \
  }
DDT_COMMIT_TABLE(ddtree_commit_req_to_token_i32, int)
DDT_COMMIT_TABLE(ddtree_commit_req_to_token_i64, ddt_i64)

// Page size > 1: copy each accepted node's KV row from its verify slot to the slot of its
// final position, for many layers in one launch (layer_ptrs: one base address per layer
// tensor [slots, ...], each row row_bytes long). grid = (chunks, bs).
//
// Every thread owns one V-wide column of one layer and does that column's moves in the
// reference's order, loading up to 8 sources before storing them: a move never reads a
// slot an earlier move wrote (sources are at positions >= their index, destinations below
// every later source), so this equals the sequential reference.
// Dynamic shared memory: 16 * W bytes.
template <typename T, typename V>
__device__ __forceinline__ void ddt_move_kv(const ddt_i64* __restrict__ layer_ptrs, int n_layers,
                                            ddt_i64 row_bytes, const T* __restrict__ table,
                                            ddt_i64 stride, const ddt_i64* __restrict__ req_pool_indices,
                                            const ddt_i64* __restrict__ prefix_lens,
                                            const ddt_i64* __restrict__ path,
                                            const ddt_i64* __restrict__ accept_lens, int W) {
  const int b = blockIdx.y;
  ddt_i64 L64 = accept_lens[b];
  const int L = (int)(L64 < 0 ? 0 : (L64 > W - 1 ? W - 1 : L64));
  if (L == 0) return;
  DDT_EXTERN_SMEM(smem_move);
  ddt_i64* s_src = reinterpret_cast<ddt_i64*>(smem_move);  // slot read by move d+1, -1 if none
  ddt_i64* s_dst = s_src + W;
  __shared__ int s_any;
  if (threadIdx.x == 0) s_any = 0;
  __syncthreads();
  const T* r = table + req_pool_indices[b] * stride + prefix_lens[b];
  for (int d = 1 + threadIdx.x; d <= L; d += blockDim.x) {
    const ddt_i64 src = path[(ddt_i64)b * W + d];
    if (src != d) {
      s_src[d - 1] = (ddt_i64)r[src];
      s_dst[d - 1] = (ddt_i64)r[d];
      atomicOr(&s_any, 1);
    } else {
      s_src[d - 1] = -1;
      s_dst[d - 1] = -1;
    }
  }
  __syncthreads();
  if (!s_any) return;
  const ddt_i64 vecs = row_bytes / (ddt_i64)sizeof(V);
  const ddt_i64 items = vecs * n_layers;
  for (ddt_i64 it = (ddt_i64)blockIdx.x * blockDim.x + threadIdx.x; it < items;
       it += (ddt_i64)gridDim.x * blockDim.x) {
    const ddt_i64 layer = it / vecs, j = it - layer * vecs;
    unsigned char* base = reinterpret_cast<unsigned char*>(layer_ptrs[layer]) + j * (ddt_i64)sizeof(V);
    for (int d0 = 0; d0 < L; d0 += 8) {
      V buf[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int d = d0 + u;
        if (d < L && s_src[d] >= 0) buf[u] = *reinterpret_cast<const V*>(base + s_src[d] * row_bytes);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int d = d0 + u;
        if (d < L && s_src[d] >= 0) *reinterpret_cast<V*>(base + s_dst[d] * row_bytes) = buf[u];
      }
    }
  }
}

#define DDT_MOVE_KV(NAME, T, V)                                                                      \
  extern "C" __global__ void __launch_bounds__(256)                                                  \
      NAME(const ddt_i64* layer_ptrs, ddt_i64 n_layers, ddt_i64 row_bytes, const T* table,           \
           ddt_i64 stride, const ddt_i64* req_pool_indices, const ddt_i64* prefix_lens,              \
           const ddt_i64* path, const ddt_i64* accept_lens, ddt_i64 W) {                            \
    ddt_move_kv<T, V>(layer_ptrs, (int)n_layers, row_bytes, table, stride, req_pool_indices,         \
                      prefix_lens, path, accept_lens, (int)W);                                       \
  }
DDT_MOVE_KV(ddtree_move_kv_i32_v16, int, uint4)
DDT_MOVE_KV(ddtree_move_kv_i32_v4, int, unsigned)
DDT_MOVE_KV(ddtree_move_kv_i32_v1, int, unsigned char)
DDT_MOVE_KV(ddtree_move_kv_i64_v16, ddt_i64, uint4)
DDT_MOVE_KV(ddtree_move_kv_i64_v4, ddt_i64, unsigned)
DDT_MOVE_KV(ddtree_move_kv_i64_v1, ddt_i64, unsigned char)
