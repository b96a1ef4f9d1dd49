// Draft logits -> per-depth top-k log-probs and token ids, as
// sglang_ddtree/tree/build.py::topk_log_probs: order by logit descending, ties to the
// smaller token id; log-prob = logit - logsumexp(row) in float32.
//
// One block per row (row = request x depth). Every element gets a 32-bit orderable key of
// its float32 value. Pass 1 reads the row once (coalesced): the row's max and sum of
// exponentials, and a histogram of the key's top 11 bits. A radix select (11 + 11 + 10
// bits, each further level a pass over the row that counts only the elements in the chosen
// bin) finds the k-th largest key T. The selection is every key > T plus, among the keys
// == T, those with the smallest ids (found in id order: each thread owns a contiguous id
// range, a block scan orders the ranges). A bitonic sort of (key, ~id) in shared memory
// gives the final order. k <= 1024.

#include "ddtree_common.cuh"

#define DDT_TOPK_THREADS 512
#define DDT_TOPK_MAXK 1024
#define DDT_TOPK_BINS 2048
#define DDT_TOPK_UNROLL 4

__device__ __forceinline__ float ddt_half_to_float(unsigned short h) {
  const unsigned s = (unsigned)(h & 0x8000u) << 16;
  const unsigned e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    const float v = (float)m * 5.9604644775390625e-08f;  // m * 2^-24, exact
    return s ? -v : v;
  }
  if (e == 31) return __uint_as_float(s | 0x7f800000u | (m << 13));
  return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
}

// dtype: 0 float32, 1 bfloat16, 2 float16
__device__ __forceinline__ float ddt_load_logit(const void* row, int dtype, ddt_i64 i) {
  if (dtype == 0) return reinterpret_cast<const float*>(row)[i];
  const unsigned short h = reinterpret_cast<const unsigned short*>(row)[i];
  if (dtype == 1) return __uint_as_float((unsigned)h << 16);
  return ddt_half_to_float(h);
}

// Block-wide inclusive scan of one value per thread (blockDim.x == DDT_TOPK_THREADS);
// returns the inclusive prefix, *total gets the sum.
__device__ __forceinline__ unsigned ddt_block_scan(unsigned v, unsigned* s_warp, unsigned* total) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  unsigned x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned y = __shfl_up_sync(DDT_FULL_MASK, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();  // s_warp may still be read from a previous scan
  if (lane == 31) s_warp[wid] = x;
  __syncthreads();
  unsigned before = 0, all = 0;
  for (int w = 0; w < DDT_TOPK_THREADS / 32; ++w) {
    const unsigned t = s_warp[w];
    if (w < wid) before += t;
    all += t;
  }
  *total = all;
  return before + x;
}

extern "C" __global__ void __launch_bounds__(DDT_TOPK_THREADS)
    ddtree_topk_logprobs(const void* __restrict__ logits,  // [rows, V] (row_stride apart)
                         ddt_i64 dtype_, ddt_i64 V, ddt_i64 row_stride, ddt_i64 k_,
                         float* __restrict__ out_lp,       // [rows, k]
                         ddt_i64* __restrict__ out_ids)    // [rows, k]
{
  const int dtype = (int)dtype_, k = (int)k_;
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const ddt_i64 r = blockIdx.x;
  const int esize = dtype == 0 ? 4 : 2;
  const void* row = reinterpret_cast<const unsigned char*>(logits) + r * row_stride * esize;

  __shared__ unsigned hist[DDT_TOPK_BINS];
  __shared__ ddt_u64 cand[DDT_TOPK_MAXK];
  __shared__ unsigned s_warp[32];
  __shared__ float s_m[32], s_s[32];
  __shared__ unsigned s_bin, s_above, s_cnt;
  __shared__ float s_lse;

  for (int i = tid; i < DDT_TOPK_BINS; i += DDT_TOPK_THREADS) hist[i] = 0u;
  if (tid == 0) s_cnt = 0u;
  __syncthreads();

  // ---- pass 1: log-sum-exp and the top-11-bit histogram
  float m = -__int_as_float(0x7f800000), s = 0.f;  // -inf, 0
  for (ddt_i64 base = 0; base < V; base += (ddt_i64)DDT_TOPK_THREADS * DDT_TOPK_UNROLL) {
    float x[DDT_TOPK_UNROLL];
#pragma unroll
    for (int u = 0; u < DDT_TOPK_UNROLL; ++u) {
      const ddt_i64 i = base + (ddt_i64)u * DDT_TOPK_THREADS + tid;
      x[u] = i < V ? ddt_load_logit(row, dtype, i) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < DDT_TOPK_UNROLL; ++u) {
      const ddt_i64 i = base + (ddt_i64)u * DDT_TOPK_THREADS + tid;
      const bool valid = i < V;
      if (valid && x[u] != -__int_as_float(0x7f800000)) {
        if (x[u] > m) {
          s = s * expf(m - x[u]) + 1.f;
          m = x[u];
        } else {
          s += expf(x[u] - m);
        }
      }
      const unsigned digit = valid ? (ddt_float_key(x[u]) >> 21) : 0xffffffffu;
      const unsigned peers = __match_any_sync(DDT_FULL_MASK, digit);
      if (valid && lane == __ffs((int)peers) - 1) atomicAdd(&hist[digit], (unsigned)__popc(peers));
    }
  }
  // combine (max, sum) pairs: warp, then block
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(DDT_FULL_MASK, m, o);
    const float s2 = __shfl_xor_sync(DDT_FULL_MASK, s, o);
    const float M = fmaxf(m, m2);
    if (M != -__int_as_float(0x7f800000)) {
      s = s * expf(m - M) + s2 * expf(m2 - M);
      m = M;
    }
  }
  if (lane == 0) {
    s_m[wid] = m;
    s_s[wid] = s;
  }
  __syncthreads();
  if (tid == 0) {
    float M = -__int_as_float(0x7f800000), S = 0.f;
    for (int w = 0; w < DDT_TOPK_THREADS / 32; ++w) {
      const float M2 = fmaxf(M, s_m[w]);
      if (M2 != -__int_as_float(0x7f800000)) {
        S = S * expf(M - M2) + s_s[w] * expf(s_m[w] - M2);
        M = M2;
      }
    }
    s_lse = M + logf(S);
  }

  // ---- radix select of the k-th largest key
  unsigned prefix = 0u;   // key bits fixed so far
  unsigned above = 0u;    // elements with a key above the current range
  bool exact = false;     // the whole current range is selected
  int level = 0;
  for (;; ++level) {
    const int shift = level == 0 ? 21 : (level == 1 ? 10 : 0);
    const int nbins = level == 2 ? 1024 : 2048;
    if (level > 0) {
      // histogram of the next digit among the elements of the chosen range
      const int hshift = level == 1 ? 21 : 10;
      __syncthreads();
      for (int i = tid; i < DDT_TOPK_BINS; i += DDT_TOPK_THREADS) hist[i] = 0u;
      __syncthreads();
      for (ddt_i64 base = 0; base < V; base += (ddt_i64)DDT_TOPK_THREADS * DDT_TOPK_UNROLL) {
        float x[DDT_TOPK_UNROLL];
#pragma unroll
        for (int u = 0; u < DDT_TOPK_UNROLL; ++u) {
          const ddt_i64 i = base + (ddt_i64)u * DDT_TOPK_THREADS + tid;
          x[u] = i < V ? ddt_load_logit(row, dtype, i) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < DDT_TOPK_UNROLL; ++u) {
          const ddt_i64 i = base + (ddt_i64)u * DDT_TOPK_THREADS + tid;
          const unsigned key = ddt_float_key(x[u]);
          const bool in = i < V && (key >> hshift) == (prefix >> hshift);
          if (__any_sync(DDT_FULL_MASK, in)) {
            const unsigned digit = in ? ((key >> shift) & (unsigned)(nbins - 1)) : 0xffffffffu;
            const unsigned peers = __match_any_sync(DDT_FULL_MASK, digit);
            if (in && lane == __ffs((int)peers) - 1) atomicAdd(&hist[digit], (unsigned)__popc(peers));
          }
        }
      }
    }
    __syncthreads();
    // find the bin holding the (k - above)-th largest key of the range: thread t owns
    // bins nbins-1-t*q ... nbins-q-t*q (descending)
    const unsigned need = (unsigned)k - above;
    const int q = nbins / DDT_TOPK_THREADS;
    unsigned mine = 0u;
    for (int j = 0; j < q; ++j) mine += hist[nbins - 1 - tid * q - j];
    unsigned total;
    const unsigned incl = ddt_block_scan(mine, s_warp, &total);
    const unsigned excl = incl - mine;
    if (excl < need && need <= incl) {
      unsigned acc = excl;
      for (int j = 0; j < q; ++j) {
        const int bin = nbins - 1 - tid * q - j;
        const unsigned h = hist[bin];
        if (acc + h >= need) {
          s_bin = (unsigned)bin;
          s_above = acc;
          break;
        }
        acc += h;
      }
    }
    __syncthreads();
    const unsigned bin = s_bin;
    above += s_above;
    prefix |= bin << shift;
    if (above + hist[bin] == (unsigned)k) {
      exact = true;
      break;
    }
    if (level == 2) break;
  }

  // ---- collect the k selected elements as (key << 32 | ~id)
  if (exact) {
    // every key >= prefix (the range's lower end) is selected: exactly k of them
    for (ddt_i64 i = tid; i < V; i += DDT_TOPK_THREADS) {
      const unsigned key = ddt_float_key(ddt_load_logit(row, dtype, i));
      if (key >= prefix) cand[atomicAdd(&s_cnt, 1u)] = ((ddt_u64)key << 32) | (0xffffffffu - (unsigned)i);
    }
  } else {
    // keys > T, and the (k - above) smallest ids with key == T (T = prefix)
    const unsigned T = prefix;
    const ddt_i64 seg = (V + DDT_TOPK_THREADS - 1) / DDT_TOPK_THREADS;
    const ddt_i64 lo = tid * seg, hi = lo + seg < V ? lo + seg : V;
    unsigned eq = 0u;
    for (ddt_i64 i = lo; i < hi; ++i) {
      const unsigned key = ddt_float_key(ddt_load_logit(row, dtype, i));
      if (key > T)
        cand[atomicAdd(&s_cnt, 1u)] = ((ddt_u64)key << 32) | (0xffffffffu - (unsigned)i);
      else if (key == T)
        ++eq;
    }
    unsigned total;
    const unsigned incl = ddt_block_scan(eq, s_warp, &total);
    unsigned j = incl - eq;
    const unsigned need = (unsigned)k - above;
    for (ddt_i64 i = lo; i < hi && j < need; ++i) {
      const unsigned key = ddt_float_key(ddt_load_logit(row, dtype, i));
      if (key == T) {
        cand[above + j] = ((ddt_u64)key << 32) | (0xffffffffu - (unsigned)i);
        ++j;
      }
    }
  }
  // ---- bitonic sort, descending, over the next power of two >= k (padding sorts last)
  int p2 = 1;
  while (p2 < k) p2 <<= 1;
  __syncthreads();
  for (int i = k + tid; i < p2; i += DDT_TOPK_THREADS) cand[i] = 0ull;
  __syncthreads();
  for (int size = 2; size <= p2; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < p2; i += DDT_TOPK_THREADS) {
        const int j = i ^ stride;
        if (j > i) {
          const ddt_u64 a = cand[i], c = cand[j];
          const bool desc = (i & size) == 0;
          if (desc ? (a < c) : (a > c)) {
            cand[i] = c;
            cand[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  const float lse = s_lse;
  for (int i = tid; i < k; i += DDT_TOPK_THREADS) {
    const ddt_u64 c = cand[i];
    out_lp[r * k + i] = ddt_key_float((unsigned)(c >> 32)) - lse;
    out_ids[r * k + i] = (ddt_i64)(0xffffffffu - (unsigned)c);
  }
}
