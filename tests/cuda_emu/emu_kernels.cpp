// The kernels of cuda/*.cu run on the CPU through emu.h, exposed to Python (numpy in and
// out) with the launch geometry and shared-memory sizes the launchers in
// sglang_ddtree/kernels/ use. Test-only: see tests/test_kernels_emulated.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "emu.h"

// clang-format off
#include "ddtree_tree.cu"
#include "ddtree_accept.cu"
#include "ddtree_topk.cu"
#include "ddtree_topk_split.cu"
// clang-format on

namespace py = pybind11;
using I64 = py::array_t<long long, py::array::c_style>;
using I32 = py::array_t<int, py::array::c_style>;
using F32 = py::array_t<float, py::array::c_style>;
using U8 = py::array_t<unsigned char, py::array::c_style>;

static long long* ptr(I64& a) { return a.mutable_data(); }

py::tuple build_tree(F32 lp, I64 ids, I64 roots, py::object prefix_obj, long long budget, long long W,
                     long long lp_in_smem, int block, size_t smem_bytes, int heap_slots) {
  const long long bs = lp.shape(0), D = lp.shape(1), K = lp.shape(2), NW = (W + 31) / 32;
  I64 tokens({bs, W}), depths({bs, W}), parents({bs, W}), sizes(bs), positions({bs, W});
  I32 words({bs, W, NW});
  // poison outputs: every element must be written
  for (I64* a : {&tokens, &depths, &parents, &sizes, &positions})
    std::fill(a->mutable_data(), a->mutable_data() + a->size(), (long long)0x5a5a5a5a5a5a5a5aLL);
  std::fill(words.mutable_data(), words.mutable_data() + words.size(), 0x5a5a5a5a);
  const long long* pre = nullptr;
  I64 prefix;
  if (!prefix_obj.is_none()) {
    prefix = prefix_obj.cast<I64>();
    pre = prefix.data();
  }
  const float* plp = lp.data();
  const long long* pids = ids.data();
  const long long* proots = roots.data();
  long long *pt = ptr(tokens), *pd = ptr(depths), *pp = ptr(parents), *ps = ptr(sizes), *ppos = ptr(positions);
  int* pw = words.mutable_data();
  // heap_slots: 0 = the shared-memory heap kernel, R = ddtree_build_tree_r<R>
  decltype(&ddtree_build_tree) fn = nullptr;
  switch (heap_slots) {
    case 0: fn = &ddtree_build_tree; break;
    case 1: fn = &ddtree_build_tree_r1; break;
    case 2: fn = &ddtree_build_tree_r2; break;
    case 3: fn = &ddtree_build_tree_r3; break;
    case 5: fn = &ddtree_build_tree_r5; break;
    default: throw std::invalid_argument("no build kernel with " + std::to_string(heap_slots) + " heap slots");
  }
  if (heap_slots && W > 32LL * heap_slots) throw std::invalid_argument("width too large for the register heap");
  emu::launch(dim3((unsigned)bs), dim3(block), smem_bytes, [=] {
    fn(plp, pids, proots, pre, D, K, budget, W, lp_in_smem, pt, pd, pp, ps, ppos, pw);
  });
  return py::make_tuple(tokens, depths, parents, sizes, positions, words);
}

U8 flat_mask(I32 words, I64 prefix, long long W, long long out_numel, int grid_x, int block) {
  const long long bs = prefix.shape(0);
  U8 out(out_numel);
  std::fill(out.mutable_data(), out.mutable_data() + out_numel, (unsigned char)7);
  const int* pw = words.data();
  const long long* pp = prefix.data();
  unsigned char* po = out.mutable_data();
  emu::launch(dim3(grid_x, (unsigned)bs), dim3(block), 0,
              [=] { ddtree_flat_mask(pw, pp, W, out_numel, po); });
  return out;
}

py::tuple accept_walk(I64 tokens, I64 parents, I64 sizes, I64 posterior, py::object prefix_obj) {
  const long long bs = tokens.shape(0), W = tokens.shape(1);
  I64 path({bs, W}), acc(bs), bonus(bs), out({bs, W}), newlens(bs), sources({bs, W});
  I32 commit(bs);
  std::fill(commit.mutable_data(), commit.mutable_data() + bs, 0x5a5a5a5a);
  for (I64* a : {&path, &acc, &bonus, &out, &newlens, &sources})
    std::fill(a->mutable_data(), a->mutable_data() + a->size(), (long long)0x5a5a5a5a5a5a5a5aLL);
  const long long* pre = nullptr;
  I64 prefix;
  if (!prefix_obj.is_none()) {
    prefix = prefix_obj.cast<I64>();
    pre = prefix.data();
  }
  const long long *pt = tokens.data(), *pp = parents.data(), *ps = sizes.data(), *pq = posterior.data();
  long long *ph = ptr(path), *pa = ptr(acc), *pb = ptr(bonus), *po = ptr(out), *pn = ptr(newlens);
  long long* psrc = ptr(sources);
  int* pc = commit.mutable_data();
  emu::launch(dim3((unsigned)bs), dim3(32), (size_t)36 * W,
              [=] { ddtree_accept_walk(pt, pp, ps, pq, pre, W, ph, pa, pb, po, pn, psrc, pc); });
  return py::make_tuple(path, acc, bonus, out, newlens, sources, commit);
}

// logits: float32 [rows, V] (dtype 0) or the raw 16-bit patterns of bfloat16 (1) / float16 (2)
py::tuple topk(py::array logits, int dtype, long long k) {
  const long long rows = logits.shape(0), V = logits.shape(1);
  F32 lp({rows, k});
  I64 ids({rows, k});
  std::fill(lp.mutable_data(), lp.mutable_data() + lp.size(), 12345.f);
  std::fill(ids.mutable_data(), ids.mutable_data() + ids.size(), -7LL);
  I32 path(rows);
  const void* pl = logits.data();
  float* plp = lp.mutable_data();
  long long* pid = ids.mutable_data();
  int* ppath = path.mutable_data();
  emu::launch(dim3((unsigned)rows), dim3(DDT_TOPK_THREADS), 0,
              [=] { ddtree_topk_logprobs(pl, dtype, V, V, k, plp, pid, ppath); });
  return py::make_tuple(lp, ids, path);
}

// The split top-k (plan from sglang_ddtree/kernels/topk.py::split_plan), launched `repeat`
// times on one workspace: the per-row counters must come back to zero after every launch.
py::tuple topk_split(py::array logits, int dtype, long long k, long long splits, long long slice_len,
                     long long merge_chunk, long long cap, int repeat) {
  const long long rows = logits.shape(0), V = logits.shape(1);
  F32 lp({rows, k});
  I64 ids({rows, k});
  std::vector<unsigned long long> ws_cand((size_t)(rows * splits * k), 0x5a5a5a5a5a5a5a5aULL);
  std::vector<float> ws_part((size_t)(rows * splits * 2), 12345.f);
  I32 counts(rows);
  std::fill(counts.mutable_data(), counts.mutable_data() + rows, 0);
  const void* pl = logits.data();
  float* plp = lp.mutable_data();
  long long* pid = ids.mutable_data();
  unsigned long long* pc = ws_cand.data();
  float* pp = ws_part.data();
  unsigned* pn = reinterpret_cast<unsigned*>(counts.mutable_data());
  decltype(&ddtree_topk_split_f32) fn = dtype == 0 ? &ddtree_topk_split_f32
                                        : dtype == 1 ? &ddtree_topk_split_bf16
                                                     : &ddtree_topk_split_f16;
  for (int rep = 0; rep < repeat; ++rep) {
    std::fill(plp, plp + lp.size(), 12345.f);
    std::fill(pid, pid + ids.size(), -7LL);
    emu::launch(dim3((unsigned)(rows * splits)), dim3(DDT_SPLIT_THREADS), (size_t)cap * 8, [=] {
      fn(pl, V, V, k, splits, slice_len, merge_chunk, cap, pc, pp, pn, plp, pid);
    });
  }
  return py::make_tuple(lp, ids, counts);
}

PYBIND11_MODULE(_ddtree_emu, m) {
  m.def("topk", &topk);
  m.def("topk_split", &topk_split);
  m.def("build_tree", &build_tree);
  m.def("flat_mask", &flat_mask);
  m.def("accept_walk", &accept_walk);
}
