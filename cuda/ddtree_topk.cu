// Draft logits -> per-depth top-k log-probs and token ids, as
// sglang_ddtree/tree/build.py::topk_log_probs: order by logit descending, ties to the
// smaller token id; log-prob = logit - logsumexp(row) in float32.
//
// One block per row (row = request x depth). Every element gets a 32-bit orderable key of
// its float32 value; candidates are sorted as (key << 32 | ~id), i.e. key descending, id
// ascending: exactly the reference order, ties included.
//
// Pass 1 reads the row once (16-byte loads where aligned): the log-sum-exp and every
// thread's two largest keys. The k-th largest of those 2 x 512 keys is a lower bound L of
// the row's k-th largest key. Pass 2 collects every element with key >= L (at least k,
// usually a few times k); if they fit in shared memory (4096), one bitonic sort finishes.
// Rows where more than 4096 elements reach L (massive ties) take the fallback: a radix
// select (11 + 11 + 10 bits) of the k-th largest key T, then every key > T and, among the
// keys == T, the smallest ids (in id order: each thread owns a contiguous id range, a block
// scan orders the ranges), then the same sort. k <= 1024.

#include "ddtree_common.cuh"
#include "ddtree_logits.cuh"

#define DDT_TOPK_THREADS 512
#define DDT_TOPK_MAXK 1024
#define DDT_TOPK_BINS 2048
#define DDT_TOPK_UNROLL 4
#define DDT_TOPK_CAP 4096

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
                         ddt_i64* __restrict__ out_ids,    // [rows, k]
                         int* __restrict__ path_taken)     // [rows] or null: 0 fast, 1 fallback
{
  const int dtype = (int)dtype_, k = (int)k_;
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const ddt_i64 r = blockIdx.x;
  const int esize = dtype == 0 ? 4 : 2;
  const unsigned char* row = reinterpret_cast<const unsigned char*>(logits) + r * row_stride * esize;
  const float NEG_INF = -__int_as_float(0x7f800000);

  __shared__ unsigned hist[DDT_TOPK_BINS];
  __shared__ ddt_u64 cand[DDT_TOPK_CAP];
  __shared__ unsigned s_warp[32];
  __shared__ float s_m[32], s_s[32];
  __shared__ unsigned s_bin, s_above, s_cnt;
  __shared__ float s_lse;

  if (tid == 0) s_cnt = 0u;

  // ---- pass 1: log-sum-exp and each thread's two largest keys
  float m = NEG_INF, s = 0.f;
  unsigned t1 = 0u, t2 = 0u;
  const int vec = 16 / esize;  // elements per 16-byte load
  const bool aligned = (reinterpret_cast<unsigned long long>(row) & 15ull) == 0ull;
  const ddt_i64 nvec = aligned ? V / vec : 0;
  for (ddt_i64 v = tid; v < nvec; v += DDT_TOPK_THREADS) {
    const uint4 raw = reinterpret_cast<const uint4*>(row)[v];
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
    float x[8];
    if (dtype == 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = __uint_as_float(w[j]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const unsigned short h = (unsigned short)(w[j >> 1] >> ((j & 1) * 16));
        x[j] = dtype == 1 ? __uint_as_float((unsigned)h << 16) : ddt_half_to_float(h);
      }
    }
    float vmax = x[0];
#pragma unroll
    for (int j = 1; j < 8; ++j)
      if (j < vec) vmax = fmaxf(vmax, x[j]);
    if (vmax != NEG_INF) {
      if (vmax > m) {
        s = (m == NEG_INF) ? 0.f : s * expf(m - vmax);
        m = vmax;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < vec) s += expf(x[j] - m);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < vec) {
        const unsigned key = ddt_float_key(x[j]);
        if (key > t1) {
          t2 = t1;
          t1 = key;
        } else if (key > t2) {
          t2 = key;
        }
      }
    }
  }
  for (ddt_i64 i = nvec * vec + tid; i < V; i += DDT_TOPK_THREADS) {
    const float x = ddt_load_logit(row, dtype, i);
    if (x != NEG_INF) {
      if (x > m) {
        s = (m == NEG_INF) ? 1.f : s * expf(m - x) + 1.f;
        m = x;
      } else {
        s += expf(x - m);
      }
    }
    const unsigned key = ddt_float_key(x);
    if (key > t1) {
      t2 = t1;
      t1 = key;
    } else if (key > t2) {
      t2 = key;
    }
  }
  // combine (max, sum) pairs: warp, then block
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(DDT_FULL_MASK, m, o);
    const float s2 = __shfl_xor_sync(DDT_FULL_MASK, s, o);
    const float M = fmaxf(m, m2);
    if (M != NEG_INF) {
      s = s * expf(m - M) + s2 * expf(m2 - M);
      m = M;
    }
  }
  if (lane == 0) {
    s_m[wid] = m;
    s_s[wid] = s;
  }
  // the lower bound: k-th largest of the threads' top-2 keys (sorted descending in cand)
  cand[tid] = t1;
  cand[tid + DDT_TOPK_THREADS] = t2;
  __syncthreads();
  if (tid == 0) {
    float M = NEG_INF, S = 0.f;
    for (int w = 0; w < DDT_TOPK_THREADS / 32; ++w) {
      const float M2 = fmaxf(M, s_m[w]);
      if (M2 != NEG_INF) {
        S = S * expf(M - M2) + s_s[w] * expf(s_m[w] - M2);
        M = M2;
      }
    }
    s_lse = M + logf(S);
  }
  for (int size = 2; size <= 2 * DDT_TOPK_THREADS; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < 2 * DDT_TOPK_THREADS; i += DDT_TOPK_THREADS) {
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
  const unsigned lb = (unsigned)cand[k - 1];
  __syncthreads();

  // ---- pass 2: every element with key >= lb (at least k of them)
  for (ddt_i64 v = tid; v < nvec; v += DDT_TOPK_THREADS) {
    const uint4 raw = reinterpret_cast<const uint4*>(row)[v];
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < vec) {
        float x;
        if (dtype == 0) {
          x = __uint_as_float(w[j]);
        } else {
          const unsigned short h = (unsigned short)(w[j >> 1] >> ((j & 1) * 16));
          x = dtype == 1 ? __uint_as_float((unsigned)h << 16) : ddt_half_to_float(h);
        }
        const unsigned key = ddt_float_key(x);
        if (key >= lb) {
          const unsigned slot = atomicAdd(&s_cnt, 1u);
          if (slot < DDT_TOPK_CAP)
            cand[slot] = ((ddt_u64)key << 32) | (0xffffffffu - (unsigned)(v * vec + j));
        }
      }
    }
  }
  for (ddt_i64 i = nvec * vec + tid; i < V; i += DDT_TOPK_THREADS) {
    const unsigned key = ddt_float_key(ddt_load_logit(row, dtype, i));
    if (key >= lb) {
      const unsigned slot = atomicAdd(&s_cnt, 1u);
      if (slot < DDT_TOPK_CAP) cand[slot] = ((ddt_u64)key << 32) | (0xffffffffu - (unsigned)i);
    }
  }
  __syncthreads();
  int n_sort = (int)s_cnt;
  const bool fast = n_sort <= DDT_TOPK_CAP;
  if (path_taken && tid == 0) path_taken[r] = fast ? 0 : 1;

  if (!fast) {
    // ---- fallback: radix select of the k-th largest key, then an exact collection
    __syncthreads();
    if (tid == 0) s_cnt = 0u;
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
        const bool valid = i < V;
        const unsigned digit = valid ? (ddt_float_key(x[u]) >> 21) : 0xffffffffu;
        const unsigned peers = __match_any_sync(DDT_FULL_MASK, digit);
        if (valid && lane == __ffs((int)peers) - 1) atomicAdd(&hist[digit], (unsigned)__popc(peers));
      }
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
    n_sort = k;
  }
  // ---- bitonic sort, descending, over the next power of two >= n_sort (padding sorts last)
  int p2 = 1;
  while (p2 < n_sort) p2 <<= 1;
  __syncthreads();
  for (int i = n_sort + tid; i < p2; i += DDT_TOPK_THREADS) cand[i] = 0ull;
  __syncthreads();
  for (int size = 2; size <= p2; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < p2; i += DDT_TOPK_THREADS) {
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
  const float lse = s_lse;
  for (int i = tid; i < k; i += DDT_TOPK_THREADS) {
    const ddt_u64 c = cand[i];
    out_lp[r * k + i] = ddt_key_float((unsigned)(c >> 32)) - lse;
    out_ids[r * k + i] = (ddt_i64)(0xffffffffu - (unsigned)c);
  }
}
