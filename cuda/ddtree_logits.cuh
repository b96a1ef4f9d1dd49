// Reading draft logits (float32 / bfloat16 / float16) as float32, shared by the top-k
// kernels. No includes of its own: the kernel files include ddtree_common.cuh first (CuPy's
// loader inlines one level of local includes).
#ifndef DDTREE_LOGITS_CUH
#define DDTREE_LOGITS_CUH

// dtype codes of the launchers
#define DDT_F32 0
#define DDT_BF16 1
#define DDT_F16 2

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

__device__ __forceinline__ float ddt_16bit_to_float(unsigned short h, int dtype) {
  return dtype == DDT_BF16 ? __uint_as_float((unsigned)h << 16) : ddt_half_to_float(h);
}

// Element i of a row of the given dtype.
__device__ __forceinline__ float ddt_load_logit(const void* row, int dtype, ddt_i64 i) {
  if (dtype == DDT_F32) return reinterpret_cast<const float*>(row)[i];
  return ddt_16bit_to_float(reinterpret_cast<const unsigned short*>(row)[i], dtype);
}

// The 16 bytes of one aligned load as floats: 4 (float32) or 8 (16-bit) of them.
__device__ __forceinline__ void ddt_unpack16(uint4 raw, int dtype, float* x) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
  if (dtype == DDT_F32) {
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = __uint_as_float(w[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = ddt_16bit_to_float((unsigned short)(w[j >> 1] >> ((j & 1) * 16)), dtype);
  }
}

// e^x for log-sum-exp terms: the hardware exp2 of x * log2(e) with results below 2^-126 flushed
// to zero. __expf without fast-math is the same exp2 plus a fix-up for such results (a compare
// and two predicated multiplies an element, about a quarter of the instructions of the top-k's
// slice read); a term below 2^-126 cannot move a sum that holds the maximum's own term, 1, in
// float32.
__device__ __forceinline__ float ddt_exp_ftz(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f));
  return y;
#else
  return __expf(x);
#endif
}

#endif  // DDTREE_LOGITS_CUH
