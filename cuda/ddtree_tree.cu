// DDTree tree build and verify-mask kernels.
//
// ddtree_build_tree: one block per request; warp 0 runs the best-first search of
// sglang_ddtree/tree/build.py::build_tree_from_topk exactly, the whole block then writes
// the batch layout of sglang_ddtree/tree/layout.py (tokens, depths, parents, tree sizes,
// positions, bit-packed ancestor mask) and, optionally, first-child / next-sibling links.
//
// The heap of the reference holds, for every popped node (and the root), at most one
// entry: the node's next child to emit (rank = number of its children popped so far). So
// the heap is an array indexed by node, and a pop is an argmax over it. Lane l of warp 0
// owns entries l, l+32, ...; it caches the best of its entries; a pop is a warp argmax of
// the lanes' bests (two 32-bit max reductions over the orderable score key, then a ballot).
// Exactly equal scores are ordered by the rank tuple (a prefix first), found by walking
// parent pointers; this only runs on an exact float64 tie. Score arithmetic is the
// reference's: score(child) = score(parent) + (double)log_prob, nothing else.
//
// ddtree_flat_mask: SGLang's flat verify custom_mask (per request row-major
// [W, prefix + W], prefix all True) from the packed words, request offsets computed on the
// device.

#include "ddtree_common.cuh"

// Is (path of node an) + (ar,) lexicographically smaller than (path of node bn) + (br,)?
// A prefix sorts before its extensions (Python tuple order).
__device__ __forceinline__ bool ddt_path_less(int an, int ar, int bn, int br, const int* par,
                                              const int* rnk, const int* dep) {
  int ad = dep[an] + 1, bd = dep[bn] + 1;
  const int alen = ad, blen = bd;
  // state (node, rank, depth): the element at `depth` is child number `rank` of `node`
  while (ad > bd) {
    ar = rnk[an];
    an = par[an];
    --ad;
  }
  while (bd > ad) {
    br = rnk[bn];
    bn = par[bn];
    --bd;
  }
  if (an == bn && ar == br) return alen < blen;
  while (an != bn) {
    ar = rnk[an];
    an = par[an];
    br = rnk[bn];
    bn = par[bn];
  }
  return ar < br;
}

// Shared-memory bytes the build kernel needs (the launcher computes the same).
//   u64 fkey[W]; double score[W]; int par, rnk, dep, cnt, first, next, last [W]; int n (x4);
//   float lp[D*K] when lp_in_smem.

extern "C" __global__ void __launch_bounds__(256)
    ddtree_build_tree(const float* __restrict__ log_probs,      // [bs, D, K]
                      const ddt_i64* __restrict__ token_ids,    // [bs, D, K]
                      const ddt_i64* __restrict__ root_tokens,  // [bs]
                      const ddt_i64* __restrict__ prefix_lens,  // [bs] or null
                      ddt_i64 D_, ddt_i64 K_, ddt_i64 budget_, ddt_i64 W_, ddt_i64 lp_in_smem,
                      ddt_i64* __restrict__ tokens,        // [bs, W]
                      ddt_i64* __restrict__ depths,        // [bs, W]
                      ddt_i64* __restrict__ parents,       // [bs, W]
                      ddt_i64* __restrict__ tree_sizes,    // [bs]
                      ddt_i64* __restrict__ positions,     // [bs, W] or null
                      int* __restrict__ mask_words,        // [bs, W, ceil(W/32)] or null
                      ddt_i64* __restrict__ first_child,   // [bs, W] or null
                      ddt_i64* __restrict__ next_sibling)  // [bs, W] or null
{
  const int D = (int)D_, K = (int)K_, W = (int)W_;
  const int budget = (int)(budget_ < W_ - 1 ? budget_ : W_ - 1);
  const int b = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31;

  DDT_EXTERN_SMEM(smem_build);
  ddt_u64* fkey = reinterpret_cast<ddt_u64*>(smem_build);
  double* score = reinterpret_cast<double*>(fkey + W);
  int* par = reinterpret_cast<int*>(score + W);
  int* rnk = par + W;
  int* dep = rnk + W;
  int* cnt = dep + W;
  int* first = cnt + W;
  int* nxt = first + W;
  int* last = nxt + W;
  int* s_n = last + W;  // 4 ints, keeps the float array 16-byte aligned when W is even
  float* s_lp = reinterpret_cast<float*>(s_n + 4);

  const float* g_lp = log_probs + (ddt_i64)b * D * K;
  const float* lp = g_lp;
  if (lp_in_smem) {
    for (int i = tid; i < D * K; i += blockDim.x) s_lp[i] = __ldg(g_lp + i);
    lp = s_lp;
    __syncthreads();
  }

  if (tid < 32) {
    ddt_u64 best_key = 0ull;
    int best_e = -1;
    if (lane == 0) {
      par[0] = -1;
      rnk[0] = 0;
      dep[0] = 0;
      cnt[0] = 0;
      score[0] = 0.0;
      first[0] = -1;
      nxt[0] = -1;
      last[0] = -1;
      const ddt_u64 k0 = (D > 0 && K > 0) ? ddt_score_key((double)lp[0]) : 0ull;
      fkey[0] = k0;
      best_key = k0;
      best_e = k0 ? 0 : -1;
    }
    __syncwarp();
    int t = 0;
    while (t < budget) {
      // warp argmax of the lanes' best keys
      const unsigned hi = (unsigned)(best_key >> 32);
      const unsigned mhi = __reduce_max_sync(DDT_FULL_MASK, hi);
      const unsigned lo = (hi == mhi) ? (unsigned)best_key : 0u;
      const unsigned mlo = __reduce_max_sync(DDT_FULL_MASK, lo);
      const ddt_u64 m = ((ddt_u64)mhi << 32) | mlo;
      if (m == 0ull) break;  // the heap is empty
      const unsigned ties = __ballot_sync(DDT_FULL_MASK, best_key == m);
      int P = __shfl_sync(DDT_FULL_MASK, best_e, __ffs(ties) - 1);
      if (ties & (ties - 1)) {  // equal float64 scores on several lanes: smallest rank tuple
        unsigned rest = ties & (ties - 1);
        while (rest) {
          const int l = __ffs(rest) - 1;
          rest &= rest - 1;
          const int Q = __shfl_sync(DDT_FULL_MASK, best_e, l);
          if (ddt_path_less(Q, cnt[Q], P, cnt[P], par, rnk, dep)) P = Q;
        }
      }
      ++t;
      const int c = cnt[P];
      const int dP = dep[P];
      const double sP = score[P];
      const double st = ddt_key_score(m);  // == sP + (double)lp[dP*K + c]
      const ddt_u64 kP = (c + 1 < K) ? ddt_score_key(sP + (double)lp[dP * K + c + 1]) : 0ull;
      const ddt_u64 kt = (dP + 1 < D) ? ddt_score_key(st + (double)lp[(dP + 1) * K]) : 0ull;
      __syncwarp();
      if (lane == 0) {
        par[t] = P;
        rnk[t] = c;
        dep[t] = dP + 1;
        cnt[t] = 0;
        score[t] = st;
        first[t] = -1;
        nxt[t] = -1;
        last[t] = -1;
        cnt[P] = c + 1;
        if (c == 0)
          first[P] = t;
        else
          nxt[last[P]] = t;
        last[P] = t;
      }
      if (lane == (P & 31)) fkey[P] = kP;
      if (lane == (t & 31)) fkey[t] = kt;
      __syncwarp();
      if (lane == (P & 31)) {
        // the popped entry was this lane's best: rescan its entries (max first; the rank
        // tuples only when the max is tied)
        best_key = 0ull;
        best_e = -1;
        bool tied = false;
#pragma unroll 4
        for (int e = lane; e <= t; e += 32) {
          const ddt_u64 k = fkey[e];
          tied = (k == best_key) || (tied && k < best_key);
          if (k > best_key) {
            best_key = k;
            best_e = e;
          }
        }
        if (tied && best_key != 0ull) {
          for (int e = best_e + 32; e <= t; e += 32)
            if (fkey[e] == best_key && ddt_path_less(e, cnt[e], best_e, cnt[best_e], par, rnk, dep)) best_e = e;
        }
      } else if (lane == (t & 31)) {
        if (kt > best_key ||
            (kt != 0ull && kt == best_key && ddt_path_less(t, 0, best_e, cnt[best_e], par, rnk, dep))) {
          best_key = kt;
          best_e = t;
        }
      }
    }
    if (lane == 0) s_n[0] = t;
  }
  __syncthreads();

  // ---------------------------------------------------------------- layout
  const int n = s_n[0];
  const ddt_i64 root = root_tokens[b];
  const ddt_i64 pre = prefix_lens ? prefix_lens[b] : 0;
  const ddt_i64 row = (ddt_i64)b * W;
  const ddt_i64* ids = token_ids + (ddt_i64)b * D * K;
  for (int i = tid; i < W; i += blockDim.x) {
    ddt_i64 tok = root, d = 0, p = -1;
    if (i >= 1 && i <= n) {
      d = dep[i];
      p = par[i];
      tok = __ldg(ids + (d - 1) * K + rnk[i]);
    }
    tokens[row + i] = tok;
    depths[row + i] = d;
    parents[row + i] = p;
    if (positions) positions[row + i] = pre + d;
    if (first_child) first_child[row + i] = (i <= n) ? first[i] : -1;
    if (next_sibling) next_sibling[row + i] = (i <= n) ? nxt[i] : -1;
  }
  if (tid == 0) tree_sizes[b] = n + 1;
  if (mask_words) {
    const int NW = (W + 31) >> 5;
    int* out = mask_words + (ddt_i64)b * W * NW;
    for (int q = tid; q < W * NW; q += blockDim.x) {
      const int i = q / NW, w = q - i * NW;
      const int lo = w << 5;
      unsigned bits = 0u;
      if (i <= n) {
        // ancestors of i (and i) whose index falls in word w; indices fall on the way up
        for (int a = i; a >= lo; a = par[a])
          if (a < lo + 32) bits |= 1u << (a - lo);
      } else if ((i >> 5) == w) {
        bits = 1u << (i & 31);
      }
      out[q] = (int)bits;
    }
  }
}

// SGLang's flat verify custom_mask. grid = (chunks, bs); each block writes part of request
// b's region [W, prefix_b + W] (row-major bytes, 1 = may attend) at offset
// sum_{b' < b} W * (prefix_b' + W). Writes past out_numel are dropped.
extern "C" __global__ void __launch_bounds__(256)
    ddtree_flat_mask(const int* __restrict__ mask_words,      // [bs, W, ceil(W/32)]
                     const ddt_i64* __restrict__ prefix_lens,  // [bs]
                     ddt_i64 W_, ddt_i64 out_numel,
                     unsigned char* __restrict__ out)          // [sum_b W * (prefix_b + W)]
{
  const int W = (int)W_;
  const int b = blockIdx.y;
  const int NW = (W + 31) >> 5;
  __shared__ ddt_i64 s_part[32];

  // offset of request b: a block reduction over the earlier prefix lengths
  ddt_i64 acc = 0;
  for (int j = threadIdx.x; j < b; j += blockDim.x) acc += (prefix_lens[j] + W) * (ddt_i64)W;
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(DDT_FULL_MASK, acc, o);
  if ((threadIdx.x & 31) == 0) s_part[threadIdx.x >> 5] = acc;
  __syncthreads();
  ddt_i64 off = 0;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) off += s_part[w];

  const ddt_i64 P = prefix_lens[b];
  const ddt_i64 cols = P + W;
  const ddt_i64 total = cols * W;
  const int* words = mask_words + (ddt_i64)b * W * NW;

  // bytes [off, off + total): an unaligned head, 16-byte vectors, an unaligned tail
  const ddt_i64 vec_lo = (off + 15) & ~(ddt_i64)15;
  ddt_i64 vec_hi = (off + total) & ~(ddt_i64)15;
  if (vec_hi < vec_lo) vec_hi = vec_lo;
  const ddt_i64 stride = (ddt_i64)gridDim.x * blockDim.x;
  const ddt_i64 first_thread = (ddt_i64)blockIdx.x * blockDim.x + threadIdx.x;

  // head and tail bytes (at most 15 each), done by the first block
  if (blockIdx.x == 0) {
    const ddt_i64 head_end = vec_lo < off + total ? vec_lo : off + total;
    for (ddt_i64 a = off + threadIdx.x; a < head_end; a += blockDim.x) {
      const ddt_i64 q = a - off, r = q / cols, c = q - r * cols;
      const unsigned char v =
          c < P ? 1 : (unsigned char)((words[r * NW + ((c - P) >> 5)] >> ((c - P) & 31)) & 1);
      if (a < out_numel) out[a] = v;
    }
    for (ddt_i64 a = (vec_hi > head_end ? vec_hi : head_end) + threadIdx.x; a < off + total;
         a += blockDim.x) {
      const ddt_i64 q = a - off, r = q / cols, c = q - r * cols;
      const unsigned char v =
          c < P ? 1 : (unsigned char)((words[r * NW + ((c - P) >> 5)] >> ((c - P) & 31)) & 1);
      if (a < out_numel) out[a] = v;
    }
  }
  for (ddt_i64 a = vec_lo + first_thread * 16; a < vec_hi; a += stride * 16) {
    ddt_i64 q = a - off;
    ddt_i64 r = q / cols, c = q - r * cols;
    unsigned v[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      unsigned bit;
      if (c < P)
        bit = 1u;
      else
        bit = ((unsigned)words[r * NW + ((c - P) >> 5)] >> ((c - P) & 31)) & 1u;
      v[j >> 2] |= bit << ((j & 3) * 8);
      if (++c == cols) {
        c = 0;
        ++r;
      }
    }
    if (a + 16 <= out_numel) {
      uint4 u;
      u.x = v[0];
      u.y = v[1];
      u.z = v[2];
      u.w = v[3];
      *reinterpret_cast<uint4*>(out + a) = u;
    } else {
      for (int j = 0; j < 16; ++j)
        if (a + j < out_numel) out[a + j] = (unsigned char)(v[j >> 2] >> ((j & 3) * 8));
    }
  }
}
