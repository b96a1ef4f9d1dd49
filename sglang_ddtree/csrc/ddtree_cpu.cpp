// DDTree on the CPU in C++: the tree build and the batch layout of sglang_ddtree/tree/
// (build.py, layout.py), with identical integer results.
//
// The build is the reference's best-first heap: entries (score, parent, rank), highest
// score first, exactly equal float64 scores ordered by the rank tuple (a prefix first),
// score(child) = score(parent) + (double)log_prob. Rank tuples are never materialised:
// two tuples are compared by walking parent pointers (only on exact ties).
//
// Built on first use by sglang_ddtree.kernels.cpu (g++ and pybind11's headers).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddtree_path.cuh"  // from cuda/ (installed as sglang_ddtree/cuda)

namespace py = pybind11;

namespace {

struct Entry {
  double score;
  int parent;
  int rank;
};

class TreeBuilder {
 public:
  std::vector<int> par, rnk, dep;
  std::vector<double> score;

  // Build one tree from log_probs/token ranks [D, K]; returns the node count n (root excluded).
  // par/rnk/dep/score have n + 1 entries afterwards (index 0 = root).
  int build(const float* lp, int D, int K, int budget) {
    par.assign(1, -1);
    rnk.assign(1, 0);
    dep.assign(1, 0);
    score.assign(1, 0.0);
    heap_.clear();
    if (budget <= 0 || D <= 0 || K <= 0) return 0;
    par.reserve(budget + 1);
    rnk.reserve(budget + 1);
    dep.reserve(budget + 1);
    score.reserve(budget + 1);
    auto lower = [this](const Entry& a, const Entry& b) {  // a pops after b
      if (a.score != b.score) return a.score < b.score;
      return path_less(b.parent, b.rank, a.parent, a.rank);
    };
    heap_.push_back(Entry{(double)lp[0], 0, 0});
    int n = 0;
    while (!heap_.empty() && n < budget) {
      std::pop_heap(heap_.begin(), heap_.end(), lower);
      const Entry e = heap_.back();
      heap_.pop_back();
      ++n;
      const int d = dep[e.parent] + 1;  // depth of the new node
      par.push_back(e.parent);
      rnk.push_back(e.rank);
      dep.push_back(d);
      score.push_back(e.score);
      if (e.rank + 1 < K) {
        heap_.push_back(Entry{score[e.parent] + (double)lp[(size_t)(d - 1) * K + e.rank + 1], e.parent, e.rank + 1});
        std::push_heap(heap_.begin(), heap_.end(), lower);
      }
      if (d < D) {
        heap_.push_back(Entry{e.score + (double)lp[(size_t)d * K], n, 0});
        std::push_heap(heap_.begin(), heap_.end(), lower);
      }
    }
    return n;
  }

 private:
  std::vector<Entry> heap_;

  // (path of node an) + (ar,) < (path of node bn) + (br,), Python tuple order: the same
  // function as the CUDA kernels' (cuda/ddtree_path.cuh).
  bool path_less(int an, int ar, int bn, int br) const {
    return ddt_path_less(an, ar, bn, br, par.data(), rnk.data(), dep.data());
  }
};

template <typename T, int F>
T* mut(py::array_t<T, F>& a) {
  return a.mutable_data();
}

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

using F32 = py::array_t<float, py::array::c_style>;
using I64 = py::array_t<int64_t, py::array::c_style>;

// Single request, as build_tree_from_topk: (node_tokens[n], depths[n], parents[n+1],
// ranks[n], scores[n], visibility[n+1, n+1]).
py::tuple build_tree(F32 log_probs, I64 token_ids, int64_t budget) {
  require(log_probs.ndim() == 2 && token_ids.ndim() == 2, "log_probs and token_ids must be [depth, k]");
  require(log_probs.shape(0) == token_ids.shape(0) && log_probs.shape(1) == token_ids.shape(1),
          "log_probs and token_ids must have the same shape");
  const int D = (int)log_probs.shape(0), K = (int)log_probs.shape(1);
  TreeBuilder tb;
  int n;
  {
    py::gil_scoped_release nogil;
    n = tb.build(log_probs.data(), D, K, (int)std::min<int64_t>(budget, 1 << 30));
  }
  I64 tokens(n), depths(n), parents(n + 1), ranks(n);
  py::array_t<double> scores(n);
  py::array_t<bool> vis({n + 1, n + 1});
  const int64_t* ids = token_ids.data();
  int64_t *pt = mut(tokens), *pd = mut(depths), *pp = mut(parents), *pr = mut(ranks);
  double* ps = mut(scores);
  bool* pv = mut(vis);
  std::memset(pv, 0, (size_t)(n + 1) * (n + 1));
  pp[0] = -1;
  pv[0] = true;
  for (int i = 1; i <= n; ++i) {
    pt[i - 1] = ids[(size_t)(tb.dep[i] - 1) * K + tb.rnk[i]];
    pd[i - 1] = tb.dep[i];
    pp[i] = tb.par[i];
    pr[i - 1] = tb.rnk[i];
    ps[i - 1] = tb.score[i];
    std::memcpy(pv + (size_t)i * (n + 1), pv + (size_t)tb.par[i] * (n + 1), (size_t)(n + 1));
    pv[(size_t)i * (n + 1) + i] = true;
  }
  return py::make_tuple(tokens, depths, parents, ranks, scores, vis);
}

// Batch, as build_tree_batch_ref + pack_mask_words + positions:
// (tokens, depths, parents, tree_sizes, positions, mask_words, visibility or None).
py::tuple build_tree_batch(F32 log_probs, I64 token_ids, I64 root_tokens, py::object prefix_lens_obj,
                           int64_t budget, int64_t width, bool want_visibility) {
  require(log_probs.ndim() == 3 && token_ids.ndim() == 3, "log_probs and token_ids must be [bs, depth, k]");
  for (int a = 0; a < 3; ++a)
    require(log_probs.shape(a) == token_ids.shape(a), "log_probs and token_ids must have the same shape");
  const int64_t bs = log_probs.shape(0);
  const int D = (int)log_probs.shape(1), K = (int)log_probs.shape(2);
  require(root_tokens.ndim() == 1 && root_tokens.shape(0) == bs, "root_tokens must be [bs]");
  require(width >= 1, "width must be >= 1");
  require(budget + 1 <= width, "width must be >= budget + 1");
  const int W = (int)width, NW = (W + 31) / 32;
  I64 prefix_lens;
  const bool has_prefix = !prefix_lens_obj.is_none();
  if (has_prefix) {
    prefix_lens = prefix_lens_obj.cast<I64>();
    require(prefix_lens.ndim() == 1 && prefix_lens.shape(0) == bs, "prefix_lens must be [bs]");
  }
  I64 tokens({bs, (int64_t)W}), depths({bs, (int64_t)W}), parents({bs, (int64_t)W}), sizes(bs),
      positions({bs, (int64_t)W});
  py::array_t<int32_t> words({bs, (int64_t)W, (int64_t)NW});
  py::array_t<bool> vis;
  if (want_visibility) vis = py::array_t<bool>({bs, (int64_t)W, (int64_t)W});
  {
    const float* lp = log_probs.data();
    const int64_t* ids = token_ids.data();
    const int64_t* roots = root_tokens.data();
    const int64_t* pre = has_prefix ? prefix_lens.data() : nullptr;
    int64_t *pt = mut(tokens), *pd = mut(depths), *pp = mut(parents), *ps = mut(sizes), *ppos = mut(positions);
    uint32_t* pw = reinterpret_cast<uint32_t*>(mut(words));
    bool* pv = want_visibility ? mut(vis) : nullptr;
    py::gil_scoped_release nogil;
    TreeBuilder tb;
    for (int64_t b = 0; b < bs; ++b) {
      const int n = tb.build(lp + (size_t)b * D * K, D, K, (int)budget);
      const int64_t off = b * W;
      const int64_t* bid = ids + (size_t)b * D * K;
      const int64_t p0 = pre ? pre[b] : 0;
      ps[b] = n + 1;
      uint32_t* bw = pw + (size_t)b * W * NW;
      std::memset(bw, 0, sizeof(uint32_t) * (size_t)W * NW);
      for (int i = 0; i < W; ++i) {
        int64_t tok = roots[b], d = 0, p = -1;
        if (i >= 1 && i <= n) {
          d = tb.dep[i];
          p = tb.par[i];
          tok = bid[(size_t)(d - 1) * K + tb.rnk[i]];
          std::memcpy(bw + (size_t)i * NW, bw + (size_t)p * NW, sizeof(uint32_t) * NW);
        }
        bw[(size_t)i * NW + (i >> 5)] |= 1u << (i & 31);
        pt[off + i] = tok;
        pd[off + i] = d;
        pp[off + i] = p;
        ppos[off + i] = p0 + d;
      }
      if (pv) {
        bool* bv = pv + (size_t)b * W * W;
        for (int i = 0; i < W; ++i)
          for (int j = 0; j < W; ++j) bv[(size_t)i * W + j] = (bw[(size_t)i * NW + (j >> 5)] >> (j & 31)) & 1u;
      }
    }
  }
  py::object vis_out = want_visibility ? py::object(vis) : py::object(py::none());
  return py::make_tuple(tokens, depths, parents, sizes, positions, words, vis_out);
}

}  // namespace

PYBIND11_MODULE(_ddtree_cpu, m) {
  m.doc() = "DDTree tree build and batch layout (C++)";
  m.def("build_tree", &build_tree, py::arg("log_probs"), py::arg("token_ids"), py::arg("budget"));
  m.def("build_tree_batch", &build_tree_batch, py::arg("log_probs"), py::arg("token_ids"), py::arg("root_tokens"),
        py::arg("prefix_lens"), py::arg("budget"), py::arg("width"), py::arg("want_visibility") = false);
}
