"""Loading and launching the CUDA kernels of ``cuda/*.cu`` through CuPy.

Nothing here imports CuPy at module import: :func:`cupy_module` tries once, on first use,
and returns None when CuPy (or a CUDA device) is missing. Modules are compiled by NVRTC
on first use (never at import) and cached: in memory for the process, on disk by CuPy
(``~/.cupy/kernel_cache``). Launches go to ``torch.cuda.current_stream()``, so they are
ordered with torch work and are captured by ``torch.cuda.graph``.
"""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path

import torch

logger = logging.getLogger("sglang_ddtree")

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
if not (CUDA_DIR / "ddtree_tree.cu").exists():  # installed: the folder is the package sglang_ddtree.cuda
    CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"

NVRTC_OPTIONS = ("-std=c++17",)
DEFAULT_SMEM_LIMIT = 48 * 1024


@functools.cache
def cupy_module():
    """The ``cupy`` module, or None when it cannot be imported (never raises)."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken CUDA install
        logger.debug("CuPy unavailable: %s", exc)
        return None
    return cupy


@functools.cache
def cuda_available() -> bool:
    """True when torch sees a CUDA device and CuPy imports and sees one too."""
    if not torch.cuda.is_available():
        return False
    cupy = cupy_module()
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


def require_cupy():
    cupy = cupy_module()
    if cupy is None or not torch.cuda.is_available():
        raise RuntimeError(
            "the DDTree CUDA kernels need a CUDA device and CuPy "
            "(pip install 'sglang-ddtree[cuda12]' or '[cuda13]')"
        )
    return cupy


def kernel_source(name: str) -> str:
    """``cuda/<name>.cu`` with its local includes inlined (so CuPy's cache key sees them)."""
    text = (CUDA_DIR / f"{name}.cu").read_text()
    out = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith('#include "') and stripped.endswith('"'):
            header = stripped[len('#include "') : -1]
            out.append((CUDA_DIR / header).read_text())
        else:
            out.append(line)
    return "\n".join(out) + "\n"


@functools.cache
def raw_module(name: str, defines: tuple[str, ...] = ()):
    """``cuda/<name>.cu`` compiled, with ``-D`` ``defines`` (benchmark variants)."""
    cupy = require_cupy()
    return cupy.RawModule(code=kernel_source(name), options=NVRTC_OPTIONS + tuple(f"-D{d}" for d in defines))


class Kernel:
    """One kernel of one module: compiled lazily, launched on the current torch stream."""

    def __init__(self, module: str, name: str, defines: tuple[str, ...] = ()):
        self.module = module
        self.name = name
        self.defines = defines
        self._raw = None
        self._fn = None
        self._smem_limit = DEFAULT_SMEM_LIMIT
        self._streams: dict[int, object] = {}

    def _load(self):
        if self._raw is None:
            self._raw = raw_module(self.module, self.defines).get_function(self.name)
            self._fn = self._raw.kernel  # compiles (first use) and loads
        return self._raw

    def __call__(self, grid, block, args, shared_mem: int = 0):
        raw = self._load()
        if shared_mem > self._smem_limit:
            raw.max_dynamic_shared_size_bytes = int(shared_mem)
            self._smem_limit = int(shared_mem)
        cupy = cupy_module()
        dev = torch.cuda.current_device()
        if cupy.cuda.runtime.getDevice() != dev:
            cupy.cuda.runtime.setDevice(dev)
        ptr = torch.cuda.current_stream(dev).cuda_stream  # by index: no device lookup (adapter/streams.py)
        stream = self._streams.get(ptr)
        if stream is None:
            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; it still works
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = cupy.cuda.ExternalStream(ptr)
            self._streams[ptr] = stream
        grid = tuple(int(g) for g in grid)
        block = tuple(int(b) for b in block)
        try:
            self._fn(grid, block, args, int(shared_mem), stream)
        except TypeError:  # an older CuPy Function signature: launch inside the stream context
            with stream:
                raw(grid, block, args, shared_mem=int(shared_mem))


@functools.cache
def kernel(module: str, name: str, defines: tuple[str, ...] = ()) -> Kernel:
    return Kernel(module, name, defines)


def ptr(t: torch.Tensor | None) -> int:
    """Device address of a tensor (0 for None)."""
    return 0 if t is None else t.data_ptr()
