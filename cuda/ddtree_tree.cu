// DDTree tree build and verify-mask kernels.
//
// ddtree_build_tree, ddtree_build_tree_r<R>: one block per request; warp 0 runs the
// best-first search of sglang_ddtree/tree/build.py::build_tree_from_topk exactly, the whole
// block then writes the batch layout of sglang_ddtree/tree/layout.py (tokens, depths,
// parents, tree sizes, positions, bit-packed ancestor mask).
//
// The heap of the reference holds, for every popped node (and the root), at most one
// entry: the node's next child to emit (rank = number of its children popped so far). So
// the heap is an array indexed by node, and a pop is an argmax over it: lane l of warp 0
// takes the max of entries l, l+32, ..., the warp takes the argmax of the lanes' maxima
// (a 32-bit max reduction over the high words of the orderable score key and a ballot; the
// low words only when high words tie). Exactly equal scores are ordered by the rank tuple
// (a prefix first), found by walking parent pointers; this only runs on an exact float64
// tie. Score arithmetic is the reference's: score(child) = score(parent) + (double)log_prob.
//
// A pop is a chain of dependent warp steps (~500-650 cycles on sm_90), so the kernels keep
// that chain short: ddtree_build_tree_r<R> (widths up to 32 R) holds each lane's R entries
// in registers and prepares the winner's pushes while the reduction is in flight;
// ddtree_build_tree keeps the heap in shared memory and serves any width.
//
// ddtree_flat_mask: SGLang's flat verify custom_mask (per request row-major
// [W, prefix + W], prefix all True) from the packed words, request offsets computed on the
// device.

#include "ddtree_common.cuh"
#include "ddtree_path.cuh"

// Shared memory of the build kernels (the launcher computes the same size):
//   u64 fkey[W]; double score[W]; int par, rnk, dep, cnt [W];
//   int n (x4); float lp[D*K] when lp_in_smem.
// par / rnk / dep are the node records (parent, child number, depth) that the layout
// reads; fkey / score / cnt are the shared-memory heap.
struct DdtBuildSmem {
  ddt_u64* fkey;
  double* score;
  int *par, *rnk, *dep, *cnt, *n;
  float* lp;
};

__device__ __forceinline__ DdtBuildSmem ddt_build_smem(unsigned char* base, int W) {
  DdtBuildSmem s;
  s.fkey = reinterpret_cast<ddt_u64*>(base);
  s.score = reinterpret_cast<double*>(s.fkey + W);
  s.par = reinterpret_cast<int*>(s.score + W);
  s.rnk = s.par + W;
  s.dep = s.rnk + W;
  s.cnt = s.dep + W;
  s.n = s.cnt + W;  // 4 ints, keeps the float array 16-byte aligned
  s.lp = reinterpret_cast<float*>(s.n + 4);
  return s;
}

__device__ __forceinline__ void ddt_write_root(const DdtBuildSmem& s) {
  s.par[0] = -1;
  s.rnk[0] = 0;
  s.dep[0] = 0;
}

// Warp argmax of the lanes' best keys `bk`: the lane holding the heap's top, -1 when the
// heap is empty, or -2 when several lanes hold exactly the same float64 key (`cand` then
// has their bits; ddt_break_tie picks among them). The high words decide unless several
// lanes share the largest one. Split in two so that a caller can put independent work
// between the reduction and its use: mhi = __reduce_max_sync(hi), then this.
__device__ __forceinline__ int ddt_warp_argmax_finish(ddt_u64 bk, unsigned hi, unsigned mhi,
                                                      unsigned& cand) {
  cand = __ballot_sync(DDT_FULL_MASK, hi == mhi);
  if (cand & (cand - 1)) {
    const unsigned lo = (hi == mhi) ? (unsigned)bk : 0u;
    const unsigned mlo = __reduce_max_sync(DDT_FULL_MASK, lo);
    if ((mhi | mlo) == 0u) return -1;
    cand = __ballot_sync(DDT_FULL_MASK, hi == mhi && (unsigned)bk == mlo);
    if (cand & (cand - 1)) return -2;
  }
  return __ffs(cand) - 1;
}

__device__ __forceinline__ int ddt_warp_argmax(ddt_u64 bk, unsigned& cand) {
  const unsigned hi = (unsigned)(bk >> 32);
  return ddt_warp_argmax_finish(bk, hi, __reduce_max_sync(DDT_FULL_MASK, hi), cand);
}

// Among the lanes in `cand` (equal keys), the one whose entry (node e, next child c) has
// the smallest rank tuple. Warp-uniform; reads the node records of other lanes.
__device__ __forceinline__ int ddt_break_tie(unsigned cand, int e, int c, const DdtBuildSmem& s) {
  __syncwarp();  // node records written by other lanes are visible
  int w = __ffs(cand) - 1;
  int P = __shfl_sync(DDT_FULL_MASK, e, w);
  int cP = __shfl_sync(DDT_FULL_MASK, c, w);
  unsigned rest = cand & (cand - 1);
  while (rest) {
    const int l = __ffs(rest) - 1;
    rest &= rest - 1;
    const int Q = __shfl_sync(DDT_FULL_MASK, e, l);
    const int cQ = __shfl_sync(DDT_FULL_MASK, c, l);
    if (ddt_path_less(Q, cQ, P, cP, s.par, s.rnk, s.dep)) {
      P = Q;
      cP = cQ;
      w = l;
    }
  }
  return w;
}

// The best-first search with the heap in shared memory (any width). Node e's heap entry
// (its next child, key fkey[e]; 0 = none) is scanned by lane e & 31. Returns the pops.
__device__ int ddt_pop_shared(const float* lp, int D, int K, int budget, int lane,
                              const DdtBuildSmem& s) {
  if (lane == 0) {
    ddt_write_root(s);
    s.cnt[0] = 0;
    s.score[0] = 0.0;
    s.fkey[0] = (D > 0 && K > 0) ? ddt_score_key((double)lp[0]) : 0ull;
  }
  int t = 0;
  while (t < budget) {
    __syncwarp();  // the stores of the previous pop are visible to every lane
    // this lane's best entry (max first; the rank tuples only when the max is tied)
    ddt_u64 bk = 0ull;
    int be = -1;
    bool tied = false;
    for (int e = lane; e <= t; e += 32) {
      const ddt_u64 k = s.fkey[e];
      tied = (k == bk) || (tied && k < bk);
      if (k > bk) {
        bk = k;
        be = e;
      }
    }
    if (tied && bk != 0ull) {
      for (int e = be + 32; e <= t; e += 32)
        if (s.fkey[e] == bk && ddt_path_less(e, s.cnt[e], be, s.cnt[be], s.par, s.rnk, s.dep)) be = e;
    }
    unsigned cand;
    int w = ddt_warp_argmax(bk, cand);
    if (w == -1) break;  // the heap is empty
    if (w == -2) w = ddt_break_tie(cand, be, be >= 0 ? s.cnt[be] : 0, s);
    const int P = __shfl_sync(DDT_FULL_MASK, be, w);
    const ddt_u64 m = __shfl_sync(DDT_FULL_MASK, bk, w);
    const int c = s.cnt[P];
    const int dP = s.dep[P];
    const double sP = s.score[P];
    const double st = ddt_key_score(m);  // == sP + (double)lp[dP*K + c], the reference's sum
    const ddt_u64 kP = (c + 1 < K) ? ddt_score_key(sP + (double)lp[dP * K + c + 1]) : 0ull;
    const ddt_u64 kt = (dP + 1 < D) ? ddt_score_key(st + (double)lp[(dP + 1) * K]) : 0ull;
    ++t;
    __syncwarp();  // every lane has read P's fields before they change
    if (lane == 0) {
      s.fkey[P] = kP;  // P's entry moves to its next child
      s.cnt[P] = c + 1;
      s.par[t] = P;  // the new node t: child number c of P
      s.rnk[t] = c;
      s.dep[t] = dP + 1;
      s.cnt[t] = 0;
      s.score[t] = st;
      s.fkey[t] = kt;
    }
  }
  return t;
}

// The best-first search with the heap in registers, for W <= 32 * R. Slot j of lane l is
// node l + 32 j: its heap key (next child's score key; 0 = none), score, children popped
// so far and depth. A pop: each lane's best slot and the two keys its pop
// would push (computed while the warp argmax is in flight), the argmax, shuffles from the
// winner, and branch-free slot updates; shared memory only receives the node records.
// Same pops, in the same order, as ddt_pop_shared.
template <int R>
struct DdtSlots {
  ddt_u64 key[R];
  double sc[R];
  int cn[R], dp[R];
};

// What popping lane `lane`'s slot bj would do: its node e, child number c, depth d,
// score sv, and the log-probs behind the keys of the entries it would push (kP:
// e's next child, kt: the new node's first child). Loaded first, keys summed later, so the
// loads overlap the warp argmax.
struct DdtPopPlan {
  int e, c, d;
  double sv;
  float lpP, lpT;
  ddt_u64 kP, kt;
};

template <int R>
__device__ __forceinline__ DdtPopPlan ddt_plan_load(const DdtSlots<R>& h, int bj, int lane,
                                                    const float* lp, int D, int K) {
  DdtPopPlan p;
  p.c = 0;
  p.d = 0;
  p.sv = 0.0;
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const bool hit = j == bj;
    p.c = hit ? h.cn[j] : p.c;
    p.d = hit ? h.dp[j] : p.d;
    p.sv = hit ? h.sc[j] : p.sv;
  }
  p.e = lane + 32 * bj;
  p.lpP = (p.c + 1 < K) ? lp[p.d * K + p.c + 1] : 0.0f;
  p.lpT = (p.d + 1 < D) ? lp[(p.d + 1) * K] : 0.0f;
  return p;
}

// st: the popped node's score (== p.sv + lp[d*K + c], as the reference sums it).
__device__ __forceinline__ void ddt_plan_keys(DdtPopPlan& p, double st, int D, int K) {
  p.kP = (p.c + 1 < K) ? ddt_sum_key(p.sv + (double)p.lpP) : 0ull;
  p.kt = (p.d + 1 < D) ? ddt_sum_key(st + (double)p.lpT) : 0ull;
}

// Lane's best slot among several with exactly its best key: the smallest rank tuple.
template <int R>
__device__ __forceinline__ int ddt_slot_tie(const DdtSlots<R>& h, int bj, ddt_u64 bk, int lane,
                                            const DdtBuildSmem& s) {
  int bc = 0;
#pragma unroll
  for (int j = 0; j < R; ++j) bc = (j == bj) ? h.cn[j] : bc;
#pragma unroll
  for (int j = 0; j < R; ++j) {
    if (j != bj && h.key[j] == bk &&
        ddt_path_less(lane + 32 * j, h.cn[j], lane + 32 * bj, bc, s.par, s.rnk, s.dep)) {
      bj = j;
      bc = h.cn[j];
    }
  }
  return bj;
}

template <int R>
__device__ int ddt_pop_registers(const float* lp, int D, int K, int budget, int lane,
                                 const DdtBuildSmem& s) {
  DdtSlots<R> h;
#pragma unroll
  for (int j = 0; j < R; ++j) {
    h.key[j] = 0ull;
    h.sc[j] = 0.0;
    h.cn[j] = 0;
    h.dp[j] = 0;
  }
  if (lane == 0) {
    ddt_write_root(s);
    h.key[0] = (D > 0 && K > 0) ? ddt_score_key((double)lp[0]) : 0ull;
  }
  int t = 0;
  while (t < budget) {
    // this lane's best slot: the max key, the lowest slot on equal keys, and whether tied
    ddt_u64 bk = h.key[0];
    int bj = 0;
    bool tied = false;
#pragma unroll
    for (int j = 1; j < R; ++j) {
      tied = (h.key[j] == bk) || (tied && h.key[j] < bk);
      bj = (h.key[j] > bk) ? j : bj;
      bk = (h.key[j] > bk) ? h.key[j] : bk;
    }
    tied = tied && bk != 0ull;
    // the warp argmax's reduction goes first; this lane's pop plan loads meanwhile
    const unsigned hi = (unsigned)(bk >> 32);
    const unsigned mhi = __reduce_max_sync(DDT_FULL_MASK, hi);
    DdtPopPlan p = ddt_plan_load<R>(h, bj, lane, lp, D, K);
    const unsigned tied_lanes = __ballot_sync(DDT_FULL_MASK, tied);
    unsigned cand;
    int w = ddt_warp_argmax_finish(bk, hi, mhi, cand);
    if (w == -1) break;  // the heap is empty
    if (w == -2) {  // rare: equal keys on several lanes; settle each lane's own ties first
      __syncwarp();  // node records written by other lanes are visible
      if (tied) {
        bj = ddt_slot_tie<R>(h, bj, bk, lane, s);
        p = ddt_plan_load<R>(h, bj, lane, lp, D, K);
      }
      w = ddt_break_tie(cand, p.e, p.c, s);
    } else if (tied_lanes & (1u << w)) {  // rare: the winner's slots tie
      __syncwarp();  // node records written by other lanes are visible
      if (lane == w) {
        bj = ddt_slot_tie<R>(h, bj, bk, lane, s);
        p = ddt_plan_load<R>(h, bj, lane, lp, D, K);
      }
    }
    const double st = ddt_key_score(bk);
    ddt_plan_keys(p, st, D, K);
    const ddt_u64 kt_w = __shfl_sync(DDT_FULL_MASK, p.kt, w);
    const double st_w = __shfl_sync(DDT_FULL_MASK, st, w);
    const int d_w = __shfl_sync(DDT_FULL_MASK, p.d, w);
    ++t;
    const bool is_w = lane == w, is_t = lane == (t & 31);
    if (is_w) {  // record node t: child number c of node e
      s.par[t] = p.e;
      s.rnk[t] = p.c;
      s.dep[t] = p.d + 1;
    }
    const int jt = t >> 5;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const bool hp = is_w && j == bj;  // the popped node's slot moves to its next child
      const bool ht = is_t && j == jt;  // node t's slot: its first child is next
      h.key[j] = ht ? kt_w : (hp ? p.kP : h.key[j]);
      h.cn[j] = ht ? 0 : (hp ? p.c + 1 : h.cn[j]);
      h.sc[j] = ht ? st_w : h.sc[j];
      h.dp[j] = ht ? d_w + 1 : h.dp[j];
    }
  }
  return t;
}

// One block per request: warp 0 pops (heap in registers when R > 0, in shared memory when
// R == 0), then the whole block writes the layout.
template <int R>
__device__ __forceinline__ void ddt_build_tree(
    const float* __restrict__ log_probs, const ddt_i64* __restrict__ token_ids,
    const ddt_i64* __restrict__ root_tokens, const ddt_i64* __restrict__ prefix_lens, ddt_i64 D_,
    ddt_i64 K_, ddt_i64 budget_, ddt_i64 W_, ddt_i64 lp_in_smem, ddt_i64* __restrict__ tokens,
    ddt_i64* __restrict__ depths, ddt_i64* __restrict__ parents, ddt_i64* __restrict__ tree_sizes,
    ddt_i64* __restrict__ positions, int* __restrict__ mask_words) {
  const int D = (int)D_, K = (int)K_, W = (int)W_;
  const int budget = (int)(budget_ < W_ - 1 ? budget_ : W_ - 1);
  const int b = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31;

  DDT_EXTERN_SMEM(smem_build);
  const DdtBuildSmem s = ddt_build_smem(smem_build, W);
  int* par = s.par;
  int* rnk = s.rnk;
  int* dep = s.dep;

  const float* g_lp = log_probs + (ddt_i64)b * D * K;
  const float* lp = g_lp;
  if (lp_in_smem) {
    for (int i = tid; i < D * K; i += blockDim.x) s.lp[i] = __ldg(g_lp + i);
    lp = s.lp;
    __syncthreads();
  }

#ifdef DDT_TIME_POPS
  long long pop_cycles = 0;
#endif
  if (tid < 32) {
#ifdef DDT_TIME_POPS
    const long long c0 = clock64();
#endif
    int pops;
    if constexpr (R == 0)
      pops = ddt_pop_shared(lp, D, K, budget, lane, s);
    else  // the launcher picks these only when the log-probs are staged in shared memory
      pops = ddt_pop_registers<R>(s.lp, D, K, budget, lane, s);
    if (lane == 0) s.n[0] = pops;
#ifdef DDT_TIME_POPS
    pop_cycles = clock64() - c0;
#endif
  }
  __syncthreads();

  const int n = s.n[0];

  // ---------------------------------------------------------------- layout
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
  }
  if (tid == 0) tree_sizes[b] = n + 1;
#ifdef DDT_TIME_POPS
  // timing builds only (sglang_ddtree.bench.tree_kernels --pop-cycles): the search's cycles
  if (tid == 0 && positions) positions[row] = pop_cycles;
#endif
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

// ddtree_build_tree (heap in shared memory, any width) and ddtree_build_tree_r<R> (heap in
// registers, W <= 32 R): same arguments, same results.
#define DDT_BUILD_KERNEL(NAME, R)                                                                  \
  extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                       \
      const float* __restrict__ log_probs,     /* [bs, D, K] */                                    \
      const ddt_i64* __restrict__ token_ids,   /* [bs, D, K] */                                    \
      const ddt_i64* __restrict__ root_tokens, /* [bs] */                                          \
      const ddt_i64* __restrict__ prefix_lens, /* [bs] or null */                                  \
      ddt_i64 D_, ddt_i64 K_, ddt_i64 budget_, ddt_i64 W_, ddt_i64 lp_in_smem,                     \
      ddt_i64* __restrict__ tokens,       /* [bs, W] */                                            \
      ddt_i64* __restrict__ depths,       /* [bs, W] */                                            \
      ddt_i64* __restrict__ parents,      /* [bs, W] */                                            \
      ddt_i64* __restrict__ tree_sizes,   /* [bs] */                                               \
      ddt_i64* __restrict__ positions,    /* [bs, W] or null */                                    \
      int* __restrict__ mask_words)       /* [bs, W, ceil(W/32)] or null */                        \
  {                                                                                                \
    ddt_build_tree<R>(log_probs, token_ids, root_tokens, prefix_lens, D_, K_, budget_, W_,         \
                      lp_in_smem, tokens, depths, parents, tree_sizes, positions, mask_words);     \
  }

DDT_BUILD_KERNEL(ddtree_build_tree, 0)
DDT_BUILD_KERNEL(ddtree_build_tree_r1, 1)
DDT_BUILD_KERNEL(ddtree_build_tree_r2, 2)
DDT_BUILD_KERNEL(ddtree_build_tree_r3, 3)
DDT_BUILD_KERNEL(ddtree_build_tree_r5, 5)

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
