// Shared helpers of the DDTree kernels. Plain CUDA C++: no torch and no standard headers,
// so the files compile with nvcc and with NVRTC (CuPy RawModule) alike.
#ifndef DDTREE_COMMON_CUH
#define DDTREE_COMMON_CUH

#ifndef DDT_EXTERN_SMEM
#define DDT_EXTERN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

#define DDT_FULL_MASK 0xffffffffu

typedef long long ddt_i64;
typedef unsigned long long ddt_u64;

// Orderable key of a float64 score: a larger score gives a larger key, +0 and -0 give the
// same key (they compare equal), every finite or -inf score gives a key > 0, and 0 means
// "no entry".
__device__ __forceinline__ ddt_u64 ddt_score_key(double s) {
  s = s + 0.0;  // -0 -> +0 (x + 0.0 is not an identity under IEEE rules, so it is kept)
  ddt_i64 b = __double_as_longlong(s);
  return b < 0 ? ~(ddt_u64)b : ((ddt_u64)b | 0x8000000000000000ull);
}

// The same key for a score that is a sum of log-probs starting from +0 (every score but the
// root entry's): such a sum is never -0 under round-to-nearest, so the +0.0 is not needed.
__device__ __forceinline__ ddt_u64 ddt_sum_key(double s) {
  ddt_i64 b = __double_as_longlong(s);
  return b < 0 ? ~(ddt_u64)b : ((ddt_u64)b | 0x8000000000000000ull);
}

__device__ __forceinline__ double ddt_key_score(ddt_u64 k) {
  ddt_u64 b = (k & 0x8000000000000000ull) ? (k & 0x7fffffffffffffffull) : ~k;
  return __longlong_as_double((ddt_i64)b);
}

// Orderable key of a float32 value (larger value, larger key; -0 == +0).
__device__ __forceinline__ unsigned ddt_float_key(float v) {
  v = v + 0.0f;
  unsigned b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float ddt_key_float(unsigned k) {
  unsigned b = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  return __uint_as_float(b);
}

#endif  // DDTREE_COMMON_CUH
