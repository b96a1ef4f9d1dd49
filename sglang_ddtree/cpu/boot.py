"""Process start-up hook of the CPU serving mode.

Runs from ``sglang_ddtree_cpu.pth`` at interpreter start, in the launcher and in
every process SGLang spawns, but only acts when ``SGLANG_USE_CPU_ENGINE=1``.
It must run before anything imports ``sgl_kernel``: that package loads a
CUDA-only shared library at import time, which fails on a machine without a GPU
driver. A stand-in for ``sgl_kernel.load_utils`` keeps the package's Python API
importable; the few CPU ops SGLang then calls are registered by
:mod:`sglang_ddtree.cpu.ops` (pure torch) and the remaining CPU gaps are closed
by :mod:`sglang_ddtree.cpu.fallbacks` once SGLang is imported.
"""

from __future__ import annotations

import os
import sys
import types

ENV_FLAG = "SGLANG_USE_CPU_ENGINE"


def cpu_mode_requested() -> bool:
    return os.environ.get(ENV_FLAG, "").strip().lower() in ("1", "true", "yes", "on")


def _stub_load_utils() -> types.ModuleType:
    stub = types.ModuleType("sgl_kernel.load_utils")
    stub.__doc__ = "sglang-ddtree CPU mode: the CUDA ops library is not loaded."
    stub._load_architecture_specific_ops = lambda: types.ModuleType("sgl_kernel_common_ops_cpu_stub")
    stub._preload_cuda_library = lambda: None
    stub._get_compute_capability = lambda: None
    return stub


def activate() -> None:
    """Install the CPU-mode import hooks (idempotent; no-op unless requested)."""
    if not cpu_mode_requested() or "sglang_ddtree.cpu.boot:active" in sys.modules:
        return
    sys.modules["sglang_ddtree.cpu.boot:active"] = types.ModuleType("marker")
    if "sgl_kernel" not in sys.modules:
        sys.modules.setdefault("sgl_kernel.load_utils", _stub_load_utils())
    from . import ops

    ops.register_cpu_ops()
