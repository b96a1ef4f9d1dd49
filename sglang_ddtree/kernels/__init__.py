"""Fast DDTree paths: CUDA kernels (``cuda/*.cu`` through CuPy), a C++ CPU builder, and
the choice between them.

* :mod:`.gpu` - typed launchers of the CUDA kernels (top-k log-probs, tree build and
  layout, flat verify mask, accept walk); CuPy compiles them on first use.
* :mod:`.topk` - the draft top-k launcher (split-vocabulary kernel, one-block-per-row
  kernel, torch path), re-exported by :mod:`.gpu`.
* :mod:`.cpp` - the C++ builder (tree build, layout), compiled on first use.
* :mod:`.mla_tree_attention` - Triton tree-verify attention at MLA shapes (prefix/tail
  split) beside its torch reference; measured by ``bench/mla_tree_attention.py``, not served.
* :mod:`.backend` - the one place that picks CUDA, C++ or the Python reference for every
  step of a round (``SGLANG_DDTREE_TREE_BACKEND``).
* :mod:`.compare` - the relative difference every self-check and benchmark reports.

Importing this package (or any of its modules) never needs CuPy, a GPU or a compiler.
"""

from .backend import get_tree_backend, select_backend

__all__ = ["get_tree_backend", "select_backend"]
