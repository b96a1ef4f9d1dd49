"""The C++ CPU builder: compiled on first use, then typed wrappers around it.

The source is ``sglang_ddtree/csrc/ddtree_cpu.cpp`` (pybind11). The first call compiles it
with the system C++ compiler (``$CXX``, else ``g++``, else ``c++``) and pybind11's headers
into a per-user cache directory, keyed by a hash of the source, the compiler flags and the
Python / pybind11 versions; later calls (and later processes) load the cached module.
Cache directory: ``ext/`` under ``config.cache_root()`` (``$SGLANG_DDTREE_CACHE_DIR``, else
``~/.cache/sglang-ddtree``).

Every function gives exactly the integers of its reference in ``sglang_ddtree.tree``
(``tests/test_cpp_builder.py``). Inputs are numpy arrays (torch CPU tensors are accepted
too); outputs are numpy arrays.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..config import compiler_override

CSRC_DIR = Path(__file__).resolve().parents[1] / "csrc"
CXX_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")


class CompilerMissingError(RuntimeError):
    """No C++ compiler was found for the C++ builder."""


def cache_dir() -> Path:
    from ..config import cache_root

    path = cache_root() / "ext"
    path.mkdir(parents=True, exist_ok=True)
    return path


def find_compiler() -> str:
    for cand in (compiler_override(), "g++", "c++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)  # type: ignore[return-value]
    raise CompilerMissingError(
        "the DDTree C++ builder needs a C++17 compiler: install g++ (e.g. `apt-get install g++`) "
        "or point $CXX at one; without it the Python reference builder is used"
    )


def compile_extension(
    name: str,
    sources: Sequence[Path],
    include_dirs: Sequence[Path] = (),
    extra_flags: Sequence[str] = (),
    depends: Sequence[Path] = (),
):
    """Compile (once) and import a pybind11 module ``name`` from ``sources``.

    ``depends`` are further files (headers) whose contents key the cache.
    """
    import pybind11

    cxx = find_compiler()
    flags = [*CXX_FLAGS, *extra_flags]
    includes = [sysconfig.get_paths()["include"], pybind11.get_include(), *map(str, include_dirs)]
    digest = hashlib.sha256()
    for part in (name, cxx, " ".join(flags), sys.version, pybind11.__version__, *includes):
        digest.update(part.encode() + b"\0")
    for path in [*sources, *depends]:
        digest.update(Path(path).read_bytes())
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    target = cache_dir() / f"{name}_{digest.hexdigest()[:16]}{suffix}"
    if not target.exists():
        fd, tmp = tempfile.mkstemp(prefix=f".{name}_", suffix=suffix, dir=target.parent)
        os.close(fd)
        cmd = [cxx, *flags, *(f"-I{i}" for i in includes), *map(str, sources), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"compiling {name} failed:\n$ {' '.join(cmd)}\n{proc.stderr[-4000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders agree on the result
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@functools.cache
def load_module():
    """The compiled ``_ddtree_cpu`` module (compiled on the first call)."""
    from ._cupy import CUDA_DIR  # cuda/ holds the tie-order header the CUDA kernels share

    header = CUDA_DIR / "ddtree_path.cuh"
    return compile_extension(
        "_ddtree_cpu", [CSRC_DIR / "ddtree_cpu.cpp"], include_dirs=[CUDA_DIR], depends=[header]
    )


def available() -> bool:
    """True if the C++ builder can be compiled/loaded here (compiles it if needed)."""
    try:
        load_module()
    except Exception:  # noqa: BLE001 - any failure means: not available
        return False
    return True


def _np(a, dtype) -> np.ndarray:
    if hasattr(a, "detach"):  # torch tensor
        a = a.detach().cpu().numpy()
    arr = np.asarray(a)
    if arr.dtype != dtype:
        if dtype == np.float32 and arr.dtype.kind == "f":
            raise TypeError(f"expected float32 log-probs, got {arr.dtype} (convert explicitly)")
        arr = arr.astype(dtype)
    return np.ascontiguousarray(arr)


def build_tree_from_topk(log_probs, token_ids, budget: int):
    """C++ version of :func:`sglang_ddtree.tree.build.build_tree_from_topk`.

    Parameters
    ----------
    log_probs : float32 ``[depth, k]``, descending per row.
    token_ids : int64 ``[depth, k]``.
    budget : int, nodes to emit (root excluded).

    Returns
    -------
    DraftTree
        ``node_tokens [n]``, ``depths [n]``, ``parents [n+1]``, ``visibility [n+1, n+1]``,
        ``ranks [n]``, ``scores [n]`` - the reference's tree, bit for bit.
    """
    from ..tree.build import DraftTree

    tokens, depths, parents, ranks, scores, vis = load_module().build_tree(
        _np(log_probs, np.float32), _np(token_ids, np.int64), int(budget)
    )
    return DraftTree(
        node_tokens=tokens, depths=depths, parents=parents, visibility=vis, ranks=ranks, scores=scores
    )


def build_tree_batch(
    log_probs,
    token_ids,
    root_tokens,
    budget: int,
    width: int,
    prefix_lens=None,
    want_visibility: bool = False,
) -> dict[str, np.ndarray]:
    """C++ version of :func:`sglang_ddtree.tree.layout.build_tree_batch_ref` (+ mask words).

    Parameters
    ----------
    log_probs : float32 ``[bs, depth, k]``, top-k log-probs per request, descending.
    token_ids : int64 ``[bs, depth, k]``.
    root_tokens : int64 ``[bs]``.
    budget : int, nodes per tree (root excluded); ``width >= budget + 1``.
    width : int, verify width ``W``.
    prefix_lens : int64 ``[bs]`` or None (positions then equal depths).
    want_visibility : also return the bool ancestor matrix.

    Returns
    -------
    dict
        ``tokens [bs, W]``, ``depths [bs, W]``, ``parents [bs, W]``, ``tree_sizes [bs]``,
        ``positions [bs, W]`` (all int64), ``mask_words [bs, W, ceil(W/32)]`` int32 (as
        :func:`~sglang_ddtree.tree.layout.pack_mask_words`), and ``visibility
        [bs, W, W]`` bool if asked for.
    """
    pre = None if prefix_lens is None else _np(prefix_lens, np.int64)
    out = load_module().build_tree_batch(
        _np(log_probs, np.float32),
        _np(token_ids, np.int64),
        _np(root_tokens, np.int64).reshape(-1),
        pre,
        int(budget),
        int(width),
        bool(want_visibility),
    )
    keys = ("tokens", "depths", "parents", "tree_sizes", "positions", "mask_words", "visibility")
    result = dict(zip(keys, out))
    if not want_visibility:
        result.pop("visibility")
    return result
