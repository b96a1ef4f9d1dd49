"""Which implementation runs each step of a round: the CUDA kernels, the C++ builder or
the Python reference. This module is the only place that chooses.

:func:`select_backend` picks ``"cuda"`` when a CUDA device and CuPy are present, else
``"cpp"`` when the C++ builder compiles (a C++ compiler and pybind11), else ``"python"``;
a preference (``auto``, ``cuda``, ``cpp``, ``python``; by default
``$SGLANG_DDTREE_TREE_BACKEND``, read in ``config.py``) forces one. The choice is logged
once. A missing CuPy or compiler never raises here: it only moves the choice down the list
(forcing an unavailable backend does raise).

Every backend has the same methods, takes torch tensors on the worker's device and
returns them there (the CPU backends copy to the host and back, as a worker would):

* ``topk(logits [n, vocab], k)`` -> ``(log_probs [n, k] float32, token_ids [n, k] int64)``;
* ``build(log_probs, token_ids [bs, depth, k], root_tokens [bs], prefix_lens [bs], budget,
  width, out=None)`` -> :class:`~sglang_ddtree.tree.types.Trees` (written into ``out`` when
  given: the CUDA build then allocates nothing and can be captured in a CUDA graph);
* ``flat_mask(trees, prefix_lens, host_lens=None)`` -> SGLang's flat verify mask;
* ``accept(trees, posterior [bs, width], prefix_lens, max_depth)`` ->
  :class:`~sglang_ddtree.tree.types.Acceptance` with the commit plan (``new_seq_lens``,
  ``sources``: the verify slot per final position, ``emitted``: int32 accept length + 1);
* ``non_argmax_accepted(acceptance, trees, top1_ids [bs, depth])`` -> ``[bs]``.

Only :class:`CudaBackend` runs CUDA code; the others run torch and numpy (C++ for the
build of :class:`CppBackend`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..tree import batched
from ..tree.types import Acceptance, Trees

logger = logging.getLogger("sglang_ddtree")

BACKENDS = ("cuda", "cpp", "python")
_logged: set[str] = set()


def _cuda_ok() -> bool:
    from ._cupy import cuda_available

    return cuda_available()


def _cpp_ok() -> bool:
    from . import cpp

    return cpp.available()


def select_backend(preference: str | None = None) -> str:
    """``"cuda"``, ``"cpp"`` or ``"python"`` (see the module docstring)."""
    if preference is None:
        from ..config import tree_backend_override

        preference = tree_backend_override()
    pref = preference.strip().lower()
    if pref not in ("auto", *BACKENDS):
        raise ValueError(f"tree backend must be one of auto, {', '.join(BACKENDS)}; got {pref!r}")
    if pref == "auto":
        if _cuda_ok():
            choice, why = "cuda", "CUDA device and CuPy present"
        elif _cpp_ok():
            choice, why = "cpp", "no CUDA device or no CuPy; C++ builder compiled"
        else:
            choice, why = "python", "no CUDA/CuPy and no C++ compiler"
    else:
        ok = {"cuda": _cuda_ok, "cpp": _cpp_ok, "python": lambda: True}[pref]()
        if not ok:
            raise RuntimeError(f"tree backend {pref!r} was asked for but is not available here")
        choice, why = pref, "forced"
    if choice not in _logged:
        _logged.add(choice)
        logger.info("DDTREE tree backend: %s (%s)", choice, why)
    return choice


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


_TREE_FIELDS = ("tokens", "depths", "parents", "positions", "tree_sizes", "mask_words")


def _to_trees(arrays: dict, device, out: Trees | None = None) -> Trees:
    trees = Trees(**{f: torch.from_numpy(np.ascontiguousarray(arrays[f])).to(device) for f in _TREE_FIELDS})
    if out is None:
        return trees
    for f in _TREE_FIELDS:
        getattr(out, f).copy_(getattr(trees, f))
    return out


class TorchSteps:
    """The steps every backend can run as torch ops on any device (no host sync)."""

    name = "torch"

    def topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        from ..tree.topk import full_vocab_topk

        return full_vocab_topk(logits, k)

    def flat_mask(
        self, trees: Trees, prefix_lens: torch.Tensor, host_lens: torch.Tensor | None = None
    ) -> torch.Tensor:
        from ..tree.layout import flat_custom_mask_torch

        return flat_custom_mask_torch(trees.visibility(), prefix_lens)

    def accept(
        self, trees: Trees, posterior: torch.Tensor, prefix_lens: torch.Tensor, max_depth: int
    ) -> Acceptance:
        acceptance = batched.accept_walk(
            trees.tokens, trees.parents, trees.tree_sizes, posterior, max_depth, prefix_lens
        )
        acceptance.sources = batched.commit_sources(acceptance.path, acceptance.accept_lens)
        acceptance.emitted = (acceptance.accept_lens + 1).to(torch.int32)
        return acceptance

    def non_argmax_accepted(
        self, acceptance: Acceptance, trees: Trees, top1_ids: torch.Tensor
    ) -> torch.Tensor:
        return batched.non_argmax_accepted(
            acceptance.path, acceptance.accept_lens, trees.tokens, trees.depths, top1_ids
        )


class CudaBackend(TorchSteps):
    """The CUDA kernels (``kernels/gpu.py``): fused top-k, build, flat mask, accept walk."""

    name = "cuda"

    def topk(self, logits, k):
        from . import gpu

        return gpu.topk_log_probs(logits.contiguous(), k)  # fused log-softmax + top-k

    def build(
        self, log_probs, token_ids, root_tokens, prefix_lens, budget: int, width: int, out=None
    ) -> Trees:
        from . import gpu

        return gpu.build_tree_batch(
            log_probs.float().contiguous(),
            token_ids.to(torch.int64).contiguous(),
            root_tokens.to(torch.int64).contiguous(),
            budget,
            width,
            prefix_lens.to(torch.int64).contiguous(),
            out=out,
        )

    def flat_mask(self, trees, prefix_lens, host_lens=None):
        """Sized from host prefix lengths or an upper bound of them (no synchronisation;
        the backends read the mask at offsets computed from the device lengths, so the
        elements past it are never read); read back from the device without either."""
        from . import gpu

        host_lens = host_lens if host_lens is not None else prefix_lens
        numel = gpu.flat_mask_numel(host_lens.tolist(), trees.width)
        out = torch.empty(numel, dtype=torch.bool, device=trees.mask_words.device)
        return gpu.flat_custom_mask(trees.mask_words, prefix_lens.to(torch.int64), out)

    def accept(self, trees, posterior, prefix_lens, max_depth):
        from . import gpu

        return gpu.accept_walk(
            trees.tokens,
            trees.parents,
            trees.tree_sizes,
            posterior.contiguous(),
            prefix_lens.to(torch.int64).contiguous(),
        )


class CppBackend(TorchSteps):
    """The C++ builder for the build; torch for the rest."""

    name = "cpp"

    def build(
        self, log_probs, token_ids, root_tokens, prefix_lens, budget: int, width: int, out=None
    ) -> Trees:
        from . import cpp

        arrays = cpp.build_tree_batch(
            _np(log_probs.float()), _np(token_ids), _np(root_tokens), budget, width, _np(prefix_lens)
        )
        return _to_trees(arrays, log_probs.device, out)


class PythonBackend(TorchSteps):
    """The reference builder (``tree/layout.py``); torch for the rest."""

    name = "python"

    def build(
        self, log_probs, token_ids, root_tokens, prefix_lens, budget: int, width: int, out=None
    ) -> Trees:
        from ..tree.layout import build_tree_batch_ref, pack_mask_words

        batch = build_tree_batch_ref(_np(log_probs.float()), _np(token_ids), _np(root_tokens), budget, width)
        arrays = {
            "tokens": batch.tokens,
            "depths": batch.depths,
            "parents": batch.parents,
            "tree_sizes": batch.tree_sizes,
            "positions": batch.positions(_np(prefix_lens)),
            "mask_words": pack_mask_words(batch.visibility),
        }
        return _to_trees(arrays, log_probs.device, out)


_CLASSES = {"cuda": CudaBackend, "cpp": CppBackend, "python": PythonBackend}


def get_tree_backend(preference: str | None = None) -> TorchSteps:
    """An instance of the selected backend (see :func:`select_backend`)."""
    return _CLASSES[select_backend(preference)]()
