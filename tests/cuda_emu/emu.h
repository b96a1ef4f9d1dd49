// A small CPU emulator for the subset of CUDA the kernels in cuda/ use, so that their
// logic runs (and is tested) on a machine without a GPU.
//
// Every CUDA thread of a block is a cooperative user-level context (ucontext); blocks run
// one after another. __syncthreads() and the warp-collective intrinsics (__syncwarp,
// __shfl*_sync, __ballot_sync, __reduce_*_sync, __match_any_sync) are barriers among the
// threads concerned; between barriers a thread runs alone, so results are deterministic. Each
// warp runs on to its next __syncthreads before the next warp starts (as far ahead of the
// others as CUDA lets a warp run), so shared memory rewritten before a slower warp read it
// shows as a wrong result. It checks barrier use (a warp whose lanes wait at different
// barriers is an error) but cannot see data races in general: those need compute-sanitizer.
//
// Include this header, then the .cu file, in a C++17 translation unit.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};

namespace emu {

enum State { RUNNABLE, WAIT_BLOCK, WAIT_WARP, DONE };

struct Thread {
  ucontext_t ctx;
  dim3 tid;
  int linear = 0;
  State st = RUNNABLE;
  std::vector<char> stack;
};

struct Ctx {
  std::vector<Thread> threads;
  ucontext_t sched;
  Thread* cur = nullptr;
  dim3 blockIdx, blockDim, gridDim;
  std::vector<unsigned long long> smem_storage;
  std::vector<unsigned long long> scratch;  // [warps][32]
  std::function<void()> body;
  std::string error;
};

inline Ctx& G() {
  static Ctx c;
  return c;
}

inline unsigned char* smem() { return reinterpret_cast<unsigned char*>(G().smem_storage.data()); }

inline int lane() { return G().cur->linear & 31; }
inline int warp() { return G().cur->linear >> 5; }
inline unsigned long long& slot(int w, int l) { return G().scratch[(size_t)w * 32 + l]; }

inline void yield_as(State s) {
  Ctx& g = G();
  g.cur->st = s;
  swapcontext(&g.cur->ctx, &g.sched);
}

inline void trampoline() {
  Ctx& g = G();
  g.body();
  g.cur->st = DONE;
  // returning resumes uc_link (the scheduler)
}

// Run warp w until each of its lanes waits at __syncthreads or is done, releasing its warp
// barriers as they fill (the warp runs ahead of the others: see the header).
inline void run_warp(int w) {
  Ctx& g = G();
  const int lo = w * 32, hi = std::min((int)g.threads.size(), w * 32 + 32);
  for (;;) {
    for (int i = lo; i < hi; ++i) {
      Thread& t = g.threads[i];
      if (t.st == RUNNABLE) {
        g.cur = &t;
        swapcontext(&g.sched, &t.ctx);
        g.cur = nullptr;
      }
    }
    int waiting_warp = 0, waiting_block = 0;  // the other lanes are done
    for (int i = lo; i < hi; ++i) {
      waiting_warp += g.threads[i].st == WAIT_WARP;
      waiting_block += g.threads[i].st == WAIT_BLOCK;
    }
    if (waiting_warp == 0) return;
    if (waiting_block > 0)
      throw std::runtime_error("emu: lanes of one warp wait at a warp barrier and at __syncthreads");
    for (int i = lo; i < hi; ++i)
      if (g.threads[i].st == WAIT_WARP) g.threads[i].st = RUNNABLE;
  }
}

// Run one block: each warp in turn to its next block barrier, then release the barrier.
inline void run_block() {
  Ctx& g = G();
  const int n = (int)g.threads.size();
  const int nwarps = (n + 31) / 32;
  for (;;) {
    for (int w = 0; w < nwarps; ++w) run_warp(w);
    bool waiting = false;  // every thread now waits at __syncthreads or is done
    for (auto& t : g.threads)
      if (t.st == WAIT_BLOCK) {
        t.st = RUNNABLE;
        waiting = true;
      }
    if (!waiting) return;
  }
}

// Launch `kernel` (a callable that runs one thread's body) over a grid.
inline void launch(dim3 grid, dim3 block, size_t smem_bytes, std::function<void()> kernel,
                   size_t stack_bytes = 256 * 1024) {
  Ctx& g = G();
  const int n = (int)(block.x * block.y * block.z);
  if (n <= 0 || n > 1024) throw std::runtime_error("emu: bad block size");
  g.gridDim = grid;
  g.blockDim = block;
  g.body = std::move(kernel);
  g.threads.assign(n, Thread());
  for (auto& t : g.threads) t.stack.resize(stack_bytes);
  g.scratch.assign((size_t)((n + 31) / 32) * 32, 0ull);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        g.blockIdx = dim3(bx, by, bz);
        // poison shared memory: kernels must not read what they did not write
        g.smem_storage.assign((smem_bytes + 7) / 8 + 1, 0xA5A5A5A5A5A5A5A5ull);
        for (int i = 0; i < n; ++i) {
          Thread& t = g.threads[i];
          t.linear = i;
          t.tid = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
          t.st = RUNNABLE;
          getcontext(&t.ctx);
          t.ctx.uc_stack.ss_sp = t.stack.data();
          t.ctx.uc_stack.ss_size = t.stack.size();
          t.ctx.uc_link = &g.sched;
          makecontext(&t.ctx, (void (*)())trampoline, 0);
        }
        run_block();
      }
}

template <class T>
inline unsigned long long to_bits(T v) {
  static_assert(sizeof(T) <= 8, "emu: 8 bytes at most");
  unsigned long long b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
inline T from_bits(unsigned long long b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

// Exchange one value per lane: returns every lane's value through `out`.
inline void exchange(unsigned long long mine, unsigned long long* out) {
  int w = warp(), l = lane();
  slot(w, l) = mine;
  yield_as(WAIT_WARP);
  for (int i = 0; i < 32; ++i) out[i] = slot(w, i);
  yield_as(WAIT_WARP);
}

}  // namespace emu

#define __global__
#define __shared__ static
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __align__(n) alignas(n)
#define __launch_bounds__(...)
#define threadIdx (emu::G().cur->tid)
#define blockIdx (emu::G().blockIdx)
#define blockDim (emu::G().blockDim)
#define gridDim (emu::G().gridDim)
#define DDT_EXTERN_SMEM(name) unsigned char* name = emu::smem()

inline void __syncthreads() { emu::yield_as(emu::WAIT_BLOCK); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::yield_as(emu::WAIT_WARP); }
inline void __threadfence_block() {}
inline void __threadfence() {}

template <class T>
inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
  unsigned long long all[32];
  emu::exchange(emu::to_bits(v), all);
  int l = emu::lane();
  int base = l & ~(width - 1);
  return emu::from_bits<T>(all[base + (src & (width - 1))]);
}
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int m, int width = 32) {
  unsigned long long all[32];
  emu::exchange(emu::to_bits(v), all);
  int l = emu::lane();
  int s = l ^ m;
  if ((s & ~(width - 1)) != (l & ~(width - 1))) s = l;
  return emu::from_bits<T>(all[s]);
}
template <class T>
inline T __shfl_down_sync(unsigned, T v, unsigned d, int width = 32) {
  unsigned long long all[32];
  emu::exchange(emu::to_bits(v), all);
  int l = emu::lane();
  int s = l + (int)d;
  if ((s & ~(width - 1)) != (l & ~(width - 1)) || s > 31) s = l;
  return emu::from_bits<T>(all[s]);
}
template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned d, int width = 32) {
  unsigned long long all[32];
  emu::exchange(emu::to_bits(v), all);
  int l = emu::lane();
  int s = l - (int)d;
  if (s < (l & ~(width - 1))) s = l;
  return emu::from_bits<T>(all[s]);
}
inline unsigned __ballot_sync(unsigned, int pred) {
  unsigned long long all[32];
  emu::exchange(pred ? 1ull : 0ull, all);
  unsigned r = 0;
  int n = (int)emu::G().threads.size();
  int base = emu::warp() * 32;
  for (int i = 0; i < 32; ++i)
    if (base + i < n && emu::G().threads[base + i].st != emu::DONE && all[i]) r |= 1u << i;
  return r;
}
inline int __any_sync(unsigned m, int p) { return __ballot_sync(m, p) != 0; }
inline int __all_sync(unsigned, int p) {
  unsigned long long all[32];
  emu::exchange(p ? 1ull : 0ull, all);
  for (int i = 0; i < 32; ++i)
    if (!all[i]) return 0;
  return 1;
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
  unsigned long long all[32];
  emu::exchange(v, all);
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r = std::max(r, (unsigned)all[i]);
  return r;
}
inline unsigned __reduce_add_sync(unsigned, unsigned v) {
  unsigned long long all[32];
  emu::exchange(v, all);
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r += (unsigned)all[i];
  return r;
}
inline unsigned __match_any_sync(unsigned, unsigned v) {
  unsigned long long all[32];
  emu::exchange(v, all);
  unsigned r = 0;
  for (int i = 0; i < 32; ++i)
    if ((unsigned)all[i] == v) r |= 1u << i;
  return r;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline long long __double_as_longlong(double d) { return emu::from_bits<long long>(emu::to_bits(d)); }
inline double __longlong_as_double(long long b) { return emu::from_bits<double>((unsigned long long)b); }
inline unsigned __float_as_uint(float f) { return (unsigned)emu::to_bits(f); }
inline float __uint_as_float(unsigned u) { return emu::from_bits<float>(u); }
inline int __float_as_int(float f) { return (int)(unsigned)emu::to_bits(f); }
inline float __int_as_float(int i) { return emu::from_bits<float>((unsigned)i); }
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
template <class T>
inline T __ldcg(const T* p) {
  return *p;
}
template <class T>
inline T atomicAdd(T* p, T v) {
  T o = *p;
  *p = o + v;
  return o;
}
template <class T>
inline T atomicOr(T* p, T v) {
  T o = *p;
  *p = o | v;
  return o;
}
template <class T>
inline T atomicMin(T* p, T v) {
  T o = *p;
  *p = std::min(o, v);
  return o;
}
template <class T>
inline T atomicMax(T* p, T v) {
  T o = *p;
  *p = std::max(o, v);
  return o;
}
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
using std::exp;
using std::fmaxf;
using std::log;
using std::max;
using std::min;
inline float __int2float_rn(int x) { return (float)x; }
inline unsigned short __bfloat16_as_ushort_dummy(unsigned short x) { return x; }
