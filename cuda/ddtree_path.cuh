// The rank-tuple order that breaks exact score ties in the best-first search, shared by the
// CUDA build kernels (cuda/ddtree_tree.cu) and the C++ builder (sglang_ddtree/csrc/
// ddtree_cpu.cpp), so both order equal scores the same way. No headers: it compiles under
// nvcc, NVRTC and a host C++ compiler alike.
#ifndef DDTREE_PATH_CUH
#define DDTREE_PATH_CUH

#if defined(__CUDACC__)
#define DDT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DDT_HOST_DEVICE inline
#endif

// Is (path of node an) + (ar,) lexicographically smaller than (path of node bn) + (br,)?
// A prefix sorts before its extensions (Python tuple order). par / rnk / dep: each node's
// parent, child number and depth (the root is node 0 at depth 0).
DDT_HOST_DEVICE bool ddt_path_less(int an, int ar, int bn, int br, const int* par, const int* rnk,
                                   const int* dep) {
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

#endif  // DDTREE_PATH_CUH
