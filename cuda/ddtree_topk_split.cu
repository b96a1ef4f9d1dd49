// Draft logits -> per-row top-k log-probs and token ids with each row's vocabulary split
// over many blocks; the same result as ddtree_topk.cu (order by logit descending, ties to
// the smaller token id, log-prob = logit - logsumexp(row) in float32), for k <= 256.
//
// One launch, rows x splits blocks of 256 threads; block (r, s) reads the slice
// [s * slice_len, (s + 1) * slice_len) of row r once (16-byte loads where aligned).
// Every element is the distinct 64-bit candidate (key << 32 | ~id), key = the orderable bits
// of its float32 value, so "larger candidate" is exactly the reference order.
//
// Stage 1, per slice: the partial log-sum-exp (max, sum of exp) and the slice's top k.
//   * Each thread's largest candidate is a sample; the k-th largest sample B is a lower
//     bound of the slice's k-th largest candidate (k distinct elements are >= B).
//   * Every element >= B is collected into shared memory. An element >= B lies in a thread whose
//     sample is >= B, and only k threads have one, so at most k x (elements per thread) are
//     collected, and usually about k. A thread whose best vector alone can reach B reads that
//     vector again; the shares of the few threads with a second such vector are read again by the
//     whole block together (a share is ~80 vectors of a 163,840-entry slice: read by its own
//     thread, 20 dependent round trips to memory). The launcher sizes the list for that worst case
//     where it is small, else for many times the usual count; a block whose collection overflows
//     the list (massive ties near the top, e.g. a repeating pattern) finds the slice's exact k-th
//     largest candidate by a bitwise descent instead (64 counting passes over the slice) and
//     collects the k candidates at or above it.
//   * The collected candidates are ranked (or sorted when many), the top k written to the
//     workspace sorted descending (zero-padded when the slice holds fewer than k).
// Stage 2, in the row's last block to finish (a per-row counter, reset by that block, so the
// workspace needs zeroing once, at allocation): the S sorted lists of k candidates. The
// launcher picks one of two merges (merge_chunk 0 or g).
//   * In registers (merge_chunk 0; S and k powers of two, k >= 4, S x k <= 4 x 256: the bs-1
//     plans, k 8 over 32 splits, k 16-64 over 16): every candidate is loaded at once, 4 a
//     thread (one round trip to L2), and pairs of lists merge keeping the top k for log2(S)
//     levels: max(A[j], B[k-1-j]) is bitonic and holds the top k of A and B, a bitonic merge
//     sorts it, with shuffles within a warp and shared memory (one barrier) across warps
//     (ddt_topk_merge_lists). Zero padding sorts last, as in the sampled merge.
//   * Otherwise (a sampled bound; e.g. 9 splits at bs 8): each list is cut into chunks of g
//     (the merge chunk); the last candidate of each full chunk is a sample. With
//     C = ceil(k / g), the C-th largest sample B' is a lower bound
//     of the row's k-th largest candidate (the chosen samples of a list are a prefix of its
//     samples, each certifies g more elements of that list), and at most (C + S) x g
//     candidates reach B' (per list, up to the first chunk whose sample is below B').
//     Those are collected, ranked, and written with the merged log-sum-exp.
// With one split, stage 1 writes the result directly.

#include "ddtree_common.cuh"
#include "ddtree_logits.cuh"

#define DDT_SPLIT_THREADS 256
#define DDT_SPLIT_MAXK 256
#define DDT_SPLIT_RANK_MAX 512  // above, the collected candidates are sorted instead of ranked
#define DDT_SPLIT_UNROLL 4
#define DDT_LSE_SLACK 16.f  // how far a vector may pass the running maximum before the sum is rescaled
// Benchmark cut points (the top-k benchmark's --phases times each; serving compiles 0): the
// block stops after 5 = the slice read with its max alone (no exp, no sample: what the loads
// cost), 6 = the read with its partial log-sum-exp (no sample), 1 = the slice read (partial
// log-sum-exp, per-thread samples), 2 = the
// block's bound and log-sum-exp, 4 = the slice's candidates collected (the re-reads included),
// 3 = collected, ranked and handed over (no merge). A cut keeps its work alive with a store the
// data never triggers.
#ifndef DDT_TOPK_CUT
#define DDT_TOPK_CUT 0
#endif
// 4 blocks of 256 threads per SM: 64 registers, no spills (without the hint ptxas spills)

__device__ __forceinline__ ddt_u64 ddt_candidate(unsigned key, unsigned id) {
  return ((ddt_u64)key << 32) | (0xffffffffu - id);
}

// The m-th largest (1-based, m <= threads) of one value per thread, in every thread: a bitonic
// sort over the block, shuffles for strides below 32, s_x for the others (12 barriers). Warp
// sorts with per-thread rank counts over the eight sorted lists (three barriers, 6c1c414) were
// slower on the H200 in a run whose files were lost; the bitonic bound's phase measures 2.6 us
// of a bs-1 k-8 launch (topk_kernels_h200_c2f98be.md, phase cuts). Ranking by binary search in
// sorted lists (two barriers) was timed against this build in one run (topk_kernels_h200_099c64d.md):
// in the merge (the slices' sorted samples) it cost ~5 us at bs 1 k 8 (17.5 against 12.5 with
// only the merge's bitonic bound back), as at 1bfcbc0 (docs/benchmarks.md); for a slice's bound
// (warp-sorted samples) it was 1.3-1.5 us faster at bs 64 and 0.2-0.9 slower at bs 1 and 8.
__device__ __forceinline__ ddt_u64 ddt_block_mth_largest(ddt_u64 v, int m, ddt_u64* s_x, ddt_u64* s_out) {
  const int tid = threadIdx.x;
  for (int size = 2; size <= DDT_SPLIT_THREADS; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      ddt_u64 w;
      if (stride >= 32) {
        s_x[tid] = v;
        __syncthreads();
        w = s_x[tid ^ stride];
        __syncthreads();
      } else {
        w = __shfl_xor_sync(DDT_FULL_MASK, v, stride);
      }
      const bool descending = (tid & size) == 0, lower = (tid & stride) == 0;
      v = (lower == descending) ? (v > w ? v : w) : (v < w ? v : w);
    }
  }
  if (tid == m - 1) *s_out = v;
  __syncthreads();
  const ddt_u64 out = *s_out;
  __syncthreads();  // s_x and s_out are reused by the caller
  return out;
}

__device__ __forceinline__ void ddt_lse_combine(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  if (M != -__int_as_float(0x7f800000)) {
    s = s * expf(m - M) + s2 * expf(m2 - M);
    m = M;
  }
}

// (max, sum of exp(x - max)) over the warp, in every lane.
__device__ __forceinline__ void ddt_warp_lse(float& m, float& s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(DDT_FULL_MASK, m, o);
    const float s2 = __shfl_xor_sync(DDT_FULL_MASK, s, o);
    ddt_lse_combine(m, s, m2, s2);
  }
}

// (max, sum of exp(x - max)) over the block, in every thread.
__device__ __forceinline__ void ddt_block_lse(float& m, float& s, float* s_m, float* s_s) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  ddt_warp_lse(m, s);
  if (lane == 0) {
    s_m[wid] = m;
    s_s[wid] = s;
  }
  __syncthreads();
  m = s_m[0];
  s = s_s[0];
  for (int w = 1; w < DDT_SPLIT_THREADS / 32; ++w) ddt_lse_combine(m, s, s_m[w], s_s[w]);
  __syncthreads();
}

// Append c to the shared candidate list when it reaches the bound. The count goes on past
// cap (nothing is written there): stage 1 then takes its overflow path, and the merge's
// sizing makes an overflow impossible.
__device__ __forceinline__ void ddt_collect(ddt_u64 c, ddt_u64 bound, ddt_u64* cand, unsigned* s_cnt, int cap) {
  if (c >= bound && c != 0ull) {
    const unsigned slot = atomicAdd(s_cnt, 1u);
    if (slot < (unsigned)cap) cand[slot] = c;
  }
}

// The sum of one value per thread, in every thread.
__device__ __forceinline__ unsigned ddt_block_sum(unsigned v, unsigned* s_warp) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(DDT_FULL_MASK, v, o);
  if ((threadIdx.x & 31) == 0) s_warp[threadIdx.x >> 5] = v;
  __syncthreads();
  unsigned total = 0u;
  for (int w = 0; w < DDT_SPLIT_THREADS / 32; ++w) total += s_warp[w];
  __syncthreads();  // s_warp is reused by the next sum
  return total;
}

// The min(n, k) largest of the n distinct candidates cand[0..n), descending, into top[0..k)
// (zeros after n). n is block-uniform and <= cap, a power of two.
__device__ void ddt_select_top(ddt_u64* cand, int n, int k, ddt_u64* top) {
  const int tid = threadIdx.x;
  if (n <= DDT_SPLIT_RANK_MAX) {
    for (int i = tid; i < n; i += DDT_SPLIT_THREADS) {
      const ddt_u64 x = cand[i];
      int rank = 0;
      for (int j = 0; j < n; ++j) rank += cand[j] > x ? 1 : 0;
      if (rank < k) top[rank] = x;
    }
  } else {
    int p2 = 1;
    while (p2 < n) p2 <<= 1;
    for (int i = n + tid; i < p2; i += DDT_SPLIT_THREADS) cand[i] = 0ull;
    __syncthreads();
    for (int size = 2; size <= p2; size <<= 1) {
      for (int stride = size >> 1; stride > 0; stride >>= 1) {
        for (int i = tid; i < p2; i += DDT_SPLIT_THREADS) {
          const int j = i ^ stride;
          if (j > i) {
            const ddt_u64 a = cand[i], c = cand[j];
            if (((i & size) == 0) ? (a < c) : (a > c)) {
              cand[i] = c;
              cand[j] = a;
            }
          }
        }
        __syncthreads();
      }
    }
    for (int i = tid; i < k; i += DDT_SPLIT_THREADS) top[i] = cand[i];
  }
  for (int i = n + tid; i < k; i += DDT_SPLIT_THREADS) top[i] = 0ull;
  __syncthreads();
}

__device__ __forceinline__ void ddt_write_final(const ddt_u64* top, int k, float lse, float* out_lp, ddt_i64* out_ids) {
  for (int i = threadIdx.x; i < k; i += DDT_SPLIT_THREADS) {
    const ddt_u64 c = top[i];
    out_lp[i] = ddt_key_float((unsigned)(c >> 32)) - lse;
    out_ids[i] = (ddt_i64)(0xffffffffu - (unsigned)c);
  }
}

// Visit this thread's elements of the slice [lo, hi) of `row`: f(x, n, first_id) on n
// consecutive elements (16-byte loads when the row is aligned, else one at a time). A thread
// sees its elements in increasing id order.
template <int DTYPE, class F>
__device__ __forceinline__ void ddt_visit_slice(const unsigned char* row, ddt_i64 lo, ddt_i64 hi, F f) {
  constexpr int VEC = DTYPE == DDT_F32 ? 4 : 8;
  const bool aligned = (reinterpret_cast<unsigned long long>(row) & 15ull) == 0ull && lo % VEC == 0;
  if (aligned) {
    const uint4* vrow = reinterpret_cast<const uint4*>(row);
    const ddt_i64 v_lo = lo / VEC, v_full = hi / VEC;
    for (ddt_i64 v0 = v_lo + threadIdx.x; v0 < v_full; v0 += (ddt_i64)DDT_SPLIT_UNROLL * DDT_SPLIT_THREADS) {
      uint4 raw[DDT_SPLIT_UNROLL];
#pragma unroll
      for (int u = 0; u < DDT_SPLIT_UNROLL; ++u) {
        const ddt_i64 v = v0 + (ddt_i64)u * DDT_SPLIT_THREADS;
        if (v < v_full) raw[u] = vrow[v];
      }
#pragma unroll
      for (int u = 0; u < DDT_SPLIT_UNROLL; ++u) {
        const ddt_i64 v = v0 + (ddt_i64)u * DDT_SPLIT_THREADS;
        if (v < v_full) {
          float x[8];
          ddt_unpack16(raw[u], DTYPE, x);
          f(x, VEC, v * VEC);
        }
      }
    }
    lo = v_full * VEC;  // the tail of a row whose length is not a multiple of VEC
  }
  for (ddt_i64 i = lo + threadIdx.x; i < hi; i += DDT_SPLIT_THREADS) {
    float x[8];
    x[0] = ddt_load_logit(row, DTYPE, i);
    f(x, 1, i);
  }
}

// Visit the whole aligned shares (as ddt_visit_slice's aligned path gives them to their
// threads) of the n threads listed in shares[], spread over the block: a share is the vectors
// v_lo + t + 256 j, so the block reads n x (vectors of the longest share) in
// DDT_SPLIT_UNROLL loads per thread at a time, not n threads each reading theirs in turn.
template <int DTYPE, class F>
__device__ __forceinline__ void ddt_visit_shares(const unsigned char* row, ddt_i64 lo, ddt_i64 hi, const int* shares,
                                                 int n, F f) {
  constexpr int VEC = DTYPE == DDT_F32 ? 4 : 8;
  const uint4* vrow = reinterpret_cast<const uint4*>(row);
  const int v_lo = (int)(lo / VEC), v_full = (int)(hi / VEC);
  const int per = (v_full - v_lo + DDT_SPLIT_THREADS - 1) / DDT_SPLIT_THREADS;
  const int total = per * n;
  for (int i0 = threadIdx.x; i0 < total; i0 += DDT_SPLIT_UNROLL * DDT_SPLIT_THREADS) {
    uint4 raw[DDT_SPLIT_UNROLL];
    int vs[DDT_SPLIT_UNROLL];
#pragma unroll
    for (int u = 0; u < DDT_SPLIT_UNROLL; ++u) {
      const int i = i0 + u * DDT_SPLIT_THREADS;
      vs[u] = i < total ? v_lo + shares[i / per] + DDT_SPLIT_THREADS * (i % per) : v_full;
      if (vs[u] < v_full) raw[u] = vrow[vs[u]];
    }
#pragma unroll
    for (int u = 0; u < DDT_SPLIT_UNROLL; ++u) {
      if (vs[u] < v_full) {
        float x[8];
        ddt_unpack16(raw[u], DTYPE, x);
        f(x, VEC, (ddt_i64)vs[u] * VEC);
      }
    }
  }
}

// The overflow path of stage 1: the k largest candidates of the slice [lo, hi) into cand,
// after a collection that did not fit. The slice's k-th largest candidate comes from a
// bitwise descent (keep a bit when at least k candidates reach the prefix with it: 64
// counting passes over the slice, each a read from L2 or HBM); exactly min(k, slice length)
// candidates reach it, and the launcher's list holds k.
template <int DTYPE>
__device__ __noinline__ void ddt_collect_kth(const unsigned char* row, ddt_i64 lo, ddt_i64 hi, int k, ddt_u64* cand,
                                unsigned* s_cnt, unsigned* s_warp) {
  ddt_u64 kth = 0ull;
  for (int bit = 63; bit >= 0; --bit) {
    const ddt_u64 trial = kth | (1ull << bit);
    unsigned count = 0u;
    ddt_visit_slice<DTYPE>(row, lo, hi, [&](const float* x, int n, ddt_i64 first) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < n && ddt_candidate(ddt_float_key(x[j]), (unsigned)(first + j)) >= trial) ++count;
    });
    if (ddt_block_sum(count, s_warp) >= (unsigned)k) kth = trial;
  }
  if (threadIdx.x == 0) *s_cnt = 0u;  // every thread read the overflowing count before the sums
  __syncthreads();
  ddt_visit_slice<DTYPE>(row, lo, hi, [&](const float* x, int n, ddt_i64 first) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const ddt_u64 c = j < n ? ddt_candidate(ddt_float_key(x[j]), (unsigned)(first + j)) : 0ull;
      if (c >= kth && c != 0ull) cand[atomicAdd(s_cnt, 1u)] = c;
    }
  });
  __syncthreads();
}

// Stage 2, sampled (merge_chunk g > 0): the last block of row r merges the S sorted candidate
// lists and partial sums.
__device__ void ddt_topk_merge(const ddt_u64* ws_cand, const float* ws_part, int S, int k, int g,
                               ddt_u64* cand, int cap, ddt_u64* s_x, ddt_u64* top, float* s_m, float* s_s,
                               unsigned* s_cnt, ddt_u64* s_bound, float* out_lp, ddt_i64* out_ids) {
  const int tid = threadIdx.x;
  const int C = (k + g - 1) / g;  // chunks per list; S * C <= threads (launcher)
  const int list = tid / C, chunk = tid % C;
  const int j_lo = chunk * g, j_hi = j_lo + g < k ? j_lo + g : k;
  const ddt_u64* mine = ws_cand + (ddt_i64)list * k;
  // the partial sums load beside the samples (both L2 round trips), not after the collection
  float m = -__int_as_float(0x7f800000), s = 0.f;
  if (tid < S) {
    m = __ldcg(ws_part + 2 * tid);
    s = __ldcg(ws_part + 2 * tid + 1);
  }
  // The chunk's first eight candidates load with its sample (the chunk's last), all in one
  // round trip to L2, before the bound is known: a sample first and the chunk after it were two
  // dependent round trips, and g <= 8 at every bs-1 plan (g = 4 at k 64 over 16 splits).
  const bool full = list < S && j_hi - j_lo == g;
  ddt_u64 c[8];
  ddt_u64 sample = full && g > 8 ? __ldcg(mine + j_hi - 1) : 0ull;
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    c[u] = list < S && j_lo + u < j_hi ? __ldcg(mine + j_lo + u) : 0ull;
    if (full && j_lo + u == j_hi - 1) sample = c[u];  // predicated: no indexing by g
  }
  const ddt_u64 bound = ddt_block_mth_largest(sample, C, s_x, s_bound);
  if (list < S) {
    // Eight loads in flight at a time (a load per step would wait on each in turn); the list
    // is sorted, so once a group ends below the bound the rest of the chunk is below too
    // (a group cut by the chunk's end is zero-padded).
#pragma unroll
    for (int u = 0; u < 8; ++u) ddt_collect(c[u], bound, cand, s_cnt, cap);
    for (int j0 = j_lo + 8; j0 < j_hi && c[7] >= bound; j0 += 8) {
#pragma unroll
      for (int u = 0; u < 8; ++u) c[u] = j0 + u < j_hi ? __ldcg(mine + j0 + u) : 0ull;
#pragma unroll
      for (int u = 0; u < 8; ++u) ddt_collect(c[u], bound, cand, s_cnt, cap);
    }
  }
  ddt_block_lse(m, s, s_m, s_s);  // its barriers also publish the collected candidates
  const int n = (int)(*s_cnt < (unsigned)cap ? *s_cnt : (unsigned)cap);
  ddt_select_top(cand, n, k, top);
  ddt_write_final(top, k, m + logf(s), out_lp, out_ids);
}

// ---- Stage 2 in registers (plans whose merge chunk is 0: S and k powers of two, 4 <= k,
// S x k <= 4 x threads; the launcher chooses). Thread t holds the candidates 4t..4t+3 of the
// row's S lists laid end to end: a list spans T = k / 4 consecutive threads, and every
// candidate is loaded at once (one round trip to L2), not a sample first and chunks after.
// Lists merge in pairs, keeping the top k, for log2(S) levels: for lists A and B sorted
// descending, max(A[j], B[k-1-j]) over j is bitonic and holds the top k of both, and a bitonic
// merge (log2 k compare-exchange stages) sorts it. Both lists of a pair compute the merge (B's
// threads hold the same sequence reversed and sort it the same way), so every thread stays
// busy, the merged list is in the threads of both, and each exchange partner is tid ^ mask:
// shuffles within a warp, shared memory with one barrier across warps.
#define DDT_MERGE_PER_THREAD 4

// w = the values of thread tid ^ mask. Across warps the values go through one of two shared
// buffers of 4 x n_act (alternating per call, so a thread that runs ahead writes the other
// one while its partner may still read this one: one barrier, not two). Every thread of the
// block calls it (the barrier); `active` (warp-uniform) skips the work of idle warps.
__device__ __forceinline__ void ddt_merge_exchange(const ddt_u64 (&c)[DDT_MERGE_PER_THREAD],
                                                   ddt_u64 (&w)[DDT_MERGE_PER_THREAD], int mask, bool active,
                                                   ddt_u64* bufs, int n_act, int& parity) {
  const int tid = threadIdx.x;
  if (mask < 32) {
    if (active) {
#pragma unroll
      for (int p = 0; p < DDT_MERGE_PER_THREAD; ++p) w[p] = __shfl_xor_sync(DDT_FULL_MASK, c[p], mask);
    }
    return;
  }
  // value p of every thread contiguous: a warp's 8-byte stores and loads without bank conflicts
  ddt_u64* buf = bufs + parity * DDT_MERGE_PER_THREAD * n_act;
  parity ^= 1;
  if (active) {
#pragma unroll
    for (int p = 0; p < DDT_MERGE_PER_THREAD; ++p) buf[p * n_act + tid] = c[p];
  }
  __syncthreads();
  if (active) {
#pragma unroll
    for (int p = 0; p < DDT_MERGE_PER_THREAD; ++p) w[p] = buf[p * n_act + (tid ^ mask)];
  }
}

__device__ __forceinline__ void ddt_keep_max(ddt_u64& hi, ddt_u64& lo) {
  const ddt_u64 a = hi;
  hi = a > lo ? a : lo;
  lo = a > lo ? lo : a;
}

// Sort descending the bitonic sequence of k held 4 a thread by the T = k / 4 threads of each
// list: position strides k/2 .. 4 are thread strides T/2 .. 1 (the lower position keeps the
// larger), strides 2 and 1 stay in registers.
__device__ __forceinline__ void ddt_bitonic_merge(ddt_u64 (&c)[DDT_MERGE_PER_THREAD],
                                                  ddt_u64 (&w)[DDT_MERGE_PER_THREAD], int T, bool active,
                                                  ddt_u64* bufs, int n_act, int& parity) {
  for (int m = T >> 1; m > 0; m >>= 1) {
    ddt_merge_exchange(c, w, m, active, bufs, n_act, parity);
    const bool lower = (threadIdx.x & m) == 0;
#pragma unroll
    for (int p = 0; p < DDT_MERGE_PER_THREAD; ++p) c[p] = lower == (c[p] > w[p]) ? c[p] : w[p];
  }
  ddt_keep_max(c[0], c[2]);
  ddt_keep_max(c[1], c[3]);
  ddt_keep_max(c[0], c[1]);
  ddt_keep_max(c[2], c[3]);
}

// The merged log-sum-exp of the S partial sums, in every lane of the calling warp (shuffles,
// no barrier: only the warps that write the result need it).
__device__ __forceinline__ void ddt_warp_lse_partials(const float* ws_part, int S, float& m, float& s) {
  const int lane = threadIdx.x & 31;
  m = -__int_as_float(0x7f800000);
  s = 0.f;
  if (lane < S) {
    m = __ldcg(ws_part + 2 * lane);
    s = __ldcg(ws_part + 2 * lane + 1);
  }
  for (int i = lane + 32; i < S; i += 32)  // more than 32 splits (forced ones)
    ddt_lse_combine(m, s, __ldcg(ws_part + 2 * i), __ldcg(ws_part + 2 * i + 1));
  ddt_warp_lse(m, s);
}

// Stage 2 in registers: the last block of row r merges the S sorted lists (bufs: 2 x S x k
// shared slots, the launcher's candidate list) and writes them as ddt_write_final does. Not
// inlined: inlined into the kernel, ptxas spilled at the launch bounds' 64 registers; alone
// it needs no stack either.
__device__ __noinline__ void ddt_topk_merge_lists(const ddt_u64* ws_cand, const float* ws_part, int S, int k,
                                                  ddt_u64* bufs, float* out_lp, ddt_i64* out_ids) {
  const int tid = threadIdx.x, T = k / DDT_MERGE_PER_THREAD, n_act = S * T;
  const bool active = (tid & ~31) < n_act;  // warp-uniform; lanes of warp 0 past n_act hold zeros
  // (w stays zero in idle warps, which skip the exchanges)
  ddt_u64 c[DDT_MERGE_PER_THREAD], w[DDT_MERGE_PER_THREAD] = {0ull, 0ull, 0ull, 0ull};
#pragma unroll
  for (int p = 0; p < DDT_MERGE_PER_THREAD; ++p)
    c[p] = tid < n_act ? __ldcg(ws_cand + DDT_MERGE_PER_THREAD * tid + p) : 0ull;
  float m = 0.f, s = 0.f;
  if ((tid & ~31) < T) ddt_warp_lse_partials(ws_part, S, m, s);  // the writers' warps, beside the lists' loads
  int parity = 0;
  // d: the threads between the two lists of a pair; the partner holds the mirrored position
  for (int d = T; d < n_act; d <<= 1) {
    ddt_merge_exchange(c, w, d | (T - 1), active, bufs, n_act, parity);
#pragma unroll
    for (int p = 0; p < DDT_MERGE_PER_THREAD; ++p) {
      const ddt_u64 b = w[DDT_MERGE_PER_THREAD - 1 - p];
      c[p] = c[p] > b ? c[p] : b;
    }
    ddt_bitonic_merge(c, w, T, active, bufs, n_act, parity);
  }
  if (tid < T) {
    const float lse = m + logf(s);
#pragma unroll
    for (int p = 0; p < DDT_MERGE_PER_THREAD; ++p) {
      const int q = DDT_MERGE_PER_THREAD * tid + p;
      out_lp[q] = ddt_key_float((unsigned)(c[p] >> 32)) - lse;
      out_ids[q] = (ddt_i64)(0xffffffffu - (unsigned)c[p]);
    }
  }
}

template <int DTYPE>
__device__ void ddt_topk_split(const void* __restrict__ logits, ddt_i64 V, ddt_i64 row_stride, ddt_i64 k_,
                               ddt_i64 splits_, ddt_i64 slice_len, ddt_i64 merge_chunk, ddt_i64 cap_,
                               ddt_u64* __restrict__ ws_cand, float* __restrict__ ws_part,
                               unsigned* __restrict__ ws_count, float* __restrict__ out_lp,
                               ddt_i64* __restrict__ out_ids) {
  const int k = (int)k_, S = (int)splits_, cap = (int)cap_, tid = threadIdx.x;
  const ddt_i64 r = (ddt_i64)blockIdx.x / S;
  const int split = (int)((ddt_i64)blockIdx.x % S);
  const ddt_i64 lo = split * slice_len, hi = lo + slice_len < V ? lo + slice_len : V;
  const int esize = DTYPE == DDT_F32 ? 4 : 2;
  const unsigned char* row = reinterpret_cast<const unsigned char*>(logits) + r * row_stride * esize;
  const float NEG_INF = -__int_as_float(0x7f800000);

  DDT_EXTERN_SMEM(smem_raw);
  ddt_u64* cand = reinterpret_cast<ddt_u64*>(smem_raw);  // [cap]
  __shared__ ddt_u64 s_x[DDT_SPLIT_THREADS];
  __shared__ ddt_u64 top[DDT_SPLIT_MAXK];
  __shared__ float s_m[DDT_SPLIT_THREADS / 32], s_s[DDT_SPLIT_THREADS / 32];
  __shared__ unsigned s_cnt, s_sum[DDT_SPLIT_THREADS / 32], s_n_shares;
  __shared__ ddt_u64 s_bound;
  __shared__ int s_last;
  if (tid == 0) s_cnt = s_n_shares = 0u;

  // ---- read the slice: partial log-sum-exp and this thread's largest element. Per vector
  // of 8 the work is float compares and one exp per element; everything else a vector does is
  // a few predicated moves, because a branch that is rare in one thread is common in a warp of
  // 32 (a new largest vector of some lane in most of a share's ~80 vectors), and a divergent
  // branch costs the warp its whole body.
  //   * The running maximum of the exponentials moves only when a vector passes it by more than
  //     DDT_LSE_SLACK (terms up to e^16 a piece cannot overflow a float sum), so the rescale is
  //     rare in a warp too; the thread's exact maximum (`best`) rebases the sum after the read.
  //   * The thread's sample is its largest vector maximum with the vector's last id: the
  //     element that holds it (key and smaller id) is at least as large, so k threads' samples
  //     still certify k distinct elements at or above the k-th largest sample (the bound below).
  //     Finding the element's own id would be a branch per new largest vector.
  // The read also keeps the second largest vector maximum of the thread (`second`) and whether
  // it read single elements (`scalar`): the collection below reads only the best vector again
  // when no other vector of the thread can reach the bound.
  float m = NEG_INF, s = 0.f;
  float best = NEG_INF, second = NEG_INF;
  int best_last = -1;  // the last id of the best vector (-1: none yet)
  bool scalar = false;
  ddt_visit_slice<DTYPE>(row, lo, hi, [&](const float* x, int n, ddt_i64 first) {
    scalar |= n == 1;
    float vmax = x[0];
#pragma unroll
    for (int j = 1; j < 8; ++j)
      if (j < n) vmax = fmaxf(vmax, x[j]);
#if DDT_TOPK_CUT == 5
    m = fmaxf(m, vmax);
    return;
#endif
    if (vmax > m + DDT_LSE_SLACK) {  // m = -inf: s is 0 and exp(-inf) is 0
      s *= ddt_exp_ftz(m - vmax);
      m = vmax;
    }
    if (m != NEG_INF) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < n) s += ddt_exp_ftz(x[j] - m);
    }
#if DDT_TOPK_CUT == 6
    return;
#endif
    const bool raises = best_last < 0 || vmax > best;
    second = raises ? best : fmaxf(second, vmax);
    best_last = raises ? (int)first + n - 1 : best_last;
    best = raises ? vmax : best;
  });
  if (best > m) {  // rebase the sum on the thread's maximum (log-sum-exp's usual form)
    s *= ddt_exp_ftz(m - best);
    m = best;
  }
  const ddt_u64 sample = best_last >= 0 ? ddt_candidate(ddt_float_key(best), (unsigned)best_last) : 0ull;
#if DDT_TOPK_CUT == 5 || DDT_TOPK_CUT == 6
  if (m + s == -1.f) ws_part[0] = m;  // (the sample is a constant 0 here: it cannot keep the read alive)
  return;
#endif
#if DDT_TOPK_CUT == 1
  if (m + s == -1.f && sample == 1ull) ws_part[0] = m;
  return;
#endif
  const ddt_u64 bound = ddt_block_mth_largest(sample, k, s_x, &s_bound);
  ddt_block_lse(m, s, s_m, s_s);
#if DDT_TOPK_CUT == 2
  if (m + s == -1.f && bound == 1ull) ws_part[0] = m;
  return;
#endif

  // ---- collect every element >= bound. Float order is key order (keys equate -0 and +0), so
  // a vector whose largest value is below the bound's value holds no candidate, and only
  // values at or above it need their key. A thread whose second largest vector maximum is
  // below the bound's value holds candidates in its best vector only, and reads just that
  // vector again (one load). A thread with a second vector reaching the bound lists itself,
  // and the block reads the listed shares again together (ddt_visit_shares); a thread that
  // read single elements (a misaligned row, a row's tail) reads its share again itself. Each
  // is HBM traffic once the slices in flight outgrow L2, but only a few threads' worth.
  const unsigned bound_key = (unsigned)(bound >> 32);
  const float bound_value = bound_key ? ddt_key_float(bound_key) : NEG_INF;
  auto collect = [&](const float* x, int n, ddt_i64 first) {
    float vmax = x[0];
#pragma unroll
    for (int j = 1; j < 8; ++j)
      if (j < n) vmax = fmaxf(vmax, x[j]);
    if (vmax < bound_value) return;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < n && x[j] >= bound_value)
        ddt_collect(ddt_candidate(ddt_float_key(x[j]), (unsigned)(first + j)), bound, cand, &s_cnt, cap);
  };
  constexpr int VEC = DTYPE == DDT_F32 ? 4 : 8;
  int* shares = reinterpret_cast<int*>(s_x);  // free after the bound
  // The best vector's load goes out before the barrier that lists the shares and is used after
  // their reads went out too: one round trip to memory for both, not one after the other.
  const bool best_again = !scalar && second < bound_value && best_last >= 0 && best >= bound_value;
  const ddt_i64 best_first = best_last - best_last % VEC;
  uint4 best_raw;
  if (best_again) best_raw = reinterpret_cast<const uint4*>(row)[best_first / VEC];
  if (scalar) {
    ddt_visit_slice<DTYPE>(row, lo, hi, collect);
  } else if (second >= bound_value) {
    shares[atomicAdd(&s_n_shares, 1u)] = tid;
  }
  __syncthreads();
  if (s_n_shares != 0u) ddt_visit_shares<DTYPE>(row, lo, hi, shares, (int)s_n_shares, collect);  // block-uniform
  if (best_again) {
    float x[8];
    ddt_unpack16(best_raw, DTYPE, x);
    collect(x, VEC, best_first);
  }
  __syncthreads();
  if (s_cnt > (unsigned)cap) ddt_collect_kth<DTYPE>(row, lo, hi, k, cand, &s_cnt, s_sum);  // block-uniform
#if DDT_TOPK_CUT == 4
  if (m + s == -1.f && s_cnt == 1u && cand[0] == 1ull) ws_part[0] = m;
  return;
#endif
  const int n = (int)(s_cnt < (unsigned)cap ? s_cnt : (unsigned)cap);
  ddt_select_top(cand, n, k, top);

  if (S == 1) {
    ddt_write_final(top, k, m + logf(s), out_lp + r * k, out_ids + r * k);
    return;
  }
  // ---- hand the slice's result over; the row's last block merges
  ddt_u64* my_list = ws_cand + ((ddt_i64)r * S + split) * k;
  for (int i = tid; i < k; i += DDT_SPLIT_THREADS) my_list[i] = top[i];
  if (tid == 0) {
    ws_part[2 * (r * S + split)] = m;
    ws_part[2 * (r * S + split) + 1] = s;
  }
#if DDT_TOPK_CUT == 3
  return;
#endif
  __syncthreads();  // the block's list and partial sums are written
  if (tid == 0) {
    // One fence for the block, after the barrier, as cooperative groups' grid sync does:
    // fences are cumulative, so it publishes every write the barrier ordered before it
    // (rather than a fence in each of the 256 threads of every block). The row's last block
    // fences again before its threads read the other blocks' lists. (One acquire-release
    // atomic in place of the fences timed the same: topk_kernels_h200_099c64d.md.)
    __threadfence();
    s_last = atomicAdd(ws_count + r, 1u) == (unsigned)(S - 1);
    s_cnt = 0u;
    if (s_last) __threadfence();
  }
  __syncthreads();
  if (!s_last) return;
  if (tid == 0) ws_count[r] = 0u;  // every block of the row has counted: ready for the next launch
  if (merge_chunk == 0) {  // the launcher's choice, block-uniform
    ddt_topk_merge_lists(ws_cand + (ddt_i64)r * S * k, ws_part + 2 * r * S, S, k, cand, out_lp + r * k,
                         out_ids + r * k);
    return;
  }
  ddt_topk_merge(ws_cand + (ddt_i64)r * S * k, ws_part + 2 * r * S, S, k, (int)merge_chunk, cand, cap, s_x, top,
                 s_m, s_s, &s_cnt, &s_bound, out_lp + r * k, out_ids + r * k);
}

#define DDT_TOPK_SPLIT_KERNEL(name, DTYPE)                                                                    \
  extern "C" __global__ void __launch_bounds__(DDT_SPLIT_THREADS, 4)                                          \
      name(const void* __restrict__ logits, ddt_i64 V, ddt_i64 row_stride, ddt_i64 k, ddt_i64 splits,       \
           ddt_i64 slice_len, ddt_i64 merge_chunk, ddt_i64 cap, ddt_u64* __restrict__ ws_cand,              \
           float* __restrict__ ws_part, unsigned* __restrict__ ws_count, float* __restrict__ out_lp,        \
           ddt_i64* __restrict__ out_ids) {                                                                  \
    ddt_topk_split<DTYPE>(logits, V, row_stride, k, splits, slice_len, merge_chunk, cap, ws_cand, ws_part, \
                          ws_count, out_lp, out_ids);                                                        \
  }

DDT_TOPK_SPLIT_KERNEL(ddtree_topk_split_f32, DDT_F32)
DDT_TOPK_SPLIT_KERNEL(ddtree_topk_split_bf16, DDT_BF16)
DDT_TOPK_SPLIT_KERNEL(ddtree_topk_split_f16, DDT_F16)
