"""Which tree implementation runs: the CUDA kernels, the C++ builder or the Python reference.

:func:`select_backend` picks ``"cuda"`` when a CUDA device and CuPy are present, else
``"cpp"`` when the C++ builder compiles (a C++ compiler and pybind11), else ``"python"``;
``$SGLANG_DDTREE_TREE_BACKEND`` (``auto``, ``cuda``, ``cpp``, ``python``) or the
``preference`` argument forces one. The choice is logged once. A missing CuPy or compiler
never raises here: it only moves the choice down the list (forcing an unavailable backend
does raise).

:func:`get_tree_backend` returns an object with the same two methods for all three:

* ``build(log_probs, token_ids, root_tokens, budget, width, prefix_lens=None)`` -> dict of
  tensors on the inputs' device: ``tokens``, ``depths``, ``parents``, ``positions``
  ``[bs, W]`` int64, ``tree_sizes [bs]`` int64, ``mask_words [bs, W, ceil(W/32)]`` int32;
* ``accept(tokens, parents, tree_sizes, posterior)`` -> dict ``path [bs, W]``,
  ``accept_lens [bs]``, ``bonus [bs]``, ``out_tokens [bs, W]`` (int64, same device).

The CPU backends copy the inputs to the host and the results back, as a worker would.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

logger = logging.getLogger("sglang_ddtree")

BACKENDS = ("cuda", "cpp", "python")
ENV_VAR = "SGLANG_DDTREE_TREE_BACKEND"
_logged: set[str] = set()


def _cuda_ok() -> bool:
    from ._cupy import cuda_available

    return cuda_available()


def _cpp_ok() -> bool:
    from . import cpp

    return cpp.available()


def select_backend(preference: str | None = None) -> str:
    """``"cuda"``, ``"cpp"`` or ``"python"`` (see the module docstring)."""
    pref = (preference or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if pref not in ("auto", *BACKENDS):
        raise ValueError(f"{ENV_VAR} must be one of auto, {', '.join(BACKENDS)}; got {pref!r}")
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


def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


class CudaTreeBackend:
    name = "cuda"

    def build(self, log_probs, token_ids, root_tokens, budget: int, width: int, prefix_lens=None) -> dict:
        from . import gpu

        out = gpu.build_tree_batch(log_probs, token_ids, root_tokens, budget, width, prefix_lens)
        return {
            "tokens": out.tokens,
            "depths": out.depths,
            "parents": out.parents,
            "tree_sizes": out.tree_sizes,
            "positions": out.positions,
            "mask_words": out.mask_words,
        }

    def accept(self, tokens, parents, tree_sizes, posterior) -> dict:
        from . import gpu

        out = gpu.accept_walk(tokens, parents, tree_sizes, posterior)
        return {
            "path": out.path,
            "accept_lens": out.accept_lens,
            "bonus": out.bonus,
            "out_tokens": out.out_tokens,
        }


class CppTreeBackend:
    name = "cpp"

    def build(self, log_probs, token_ids, root_tokens, budget: int, width: int, prefix_lens=None) -> dict:
        from . import cpp

        device = log_probs.device if isinstance(log_probs, torch.Tensor) else torch.device("cpu")
        res = cpp.build_tree_batch(
            _np(log_probs.float() if isinstance(log_probs, torch.Tensor) else log_probs),
            _np(token_ids),
            _np(root_tokens),
            budget,
            width,
            None if prefix_lens is None else _np(prefix_lens),
        )
        return {k: torch.from_numpy(v).to(device) for k, v in res.items()}

    def accept(self, tokens, parents, tree_sizes, posterior) -> dict:
        from . import cpp

        device = tokens.device if isinstance(tokens, torch.Tensor) else torch.device("cpu")
        acc = cpp.accept_walk(_np(tokens), _np(parents), _np(tree_sizes), _np(posterior))
        return {
            "path": torch.from_numpy(acc.path).to(device),
            "accept_lens": torch.from_numpy(acc.accept_lens).to(device),
            "bonus": torch.from_numpy(acc.bonus).to(device),
            "out_tokens": torch.from_numpy(acc.out_tokens).to(device),
        }


class PythonTreeBackend:
    name = "python"

    def build(self, log_probs, token_ids, root_tokens, budget: int, width: int, prefix_lens=None) -> dict:
        from ..tree.layout import build_tree_batch_ref, pack_mask_words

        device = log_probs.device if isinstance(log_probs, torch.Tensor) else torch.device("cpu")
        lp = _np(log_probs).astype(np.float32)
        batch = build_tree_batch_ref(lp, _np(token_ids), _np(root_tokens), budget, width)
        pre = np.zeros(lp.shape[0], dtype=np.int64) if prefix_lens is None else _np(prefix_lens)
        res = {
            "tokens": batch.tokens,
            "depths": batch.depths,
            "parents": batch.parents,
            "tree_sizes": batch.tree_sizes,
            "positions": batch.positions(pre),
            "mask_words": pack_mask_words(batch.visibility),
        }
        return {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in res.items()}

    def accept(self, tokens, parents, tree_sizes, posterior) -> dict:
        from ..tree.accept import accept_walk_ref

        device = tokens.device if isinstance(tokens, torch.Tensor) else torch.device("cpu")
        acc = accept_walk_ref(_np(tokens), _np(parents), _np(tree_sizes), _np(posterior))
        return {
            "path": torch.from_numpy(acc.path).to(device),
            "accept_lens": torch.from_numpy(acc.accept_lens).to(device),
            "bonus": torch.from_numpy(acc.bonus).to(device),
            "out_tokens": torch.from_numpy(acc.out_tokens).to(device),
        }


_CLASSES = {"cuda": CudaTreeBackend, "cpp": CppTreeBackend, "python": PythonTreeBackend}


def get_tree_backend(preference: str | None = None):
    """An instance of the selected backend (see :func:`select_backend`)."""
    return _CLASSES[select_backend(preference)]()
