"""Process start-up hook of the CPU serving mode.

Runs from ``sglang_ddtree_cpu.pth`` at interpreter start, in the launcher and in
every process SGLang spawns, but only acts when ``SGLANG_USE_CPU_ENGINE=1``.
It must run before anything imports ``sgl_kernel``: that package loads a
CUDA-only shared library at import time, which fails on a machine without a GPU
driver. A stand-in for ``sgl_kernel.load_utils`` keeps the package's Python API
importable; the few CPU ops SGLang then calls are registered by
:mod:`sglang_ddtree.cpu.ops` (pure torch) right before the process first imports
``sglang`` or ``sgl_kernel`` (a process that never does, such as multiprocessing's
resource tracker, does not import torch for them), and the remaining CPU gaps are
closed by :mod:`sglang_ddtree.cpu.fallbacks` once SGLang is imported.
"""

from __future__ import annotations

import importlib.abc
import sys
import types

from ..config import cpu_engine_requested


def _stub_load_utils() -> types.ModuleType:
    stub = types.ModuleType("sgl_kernel.load_utils")
    stub.__doc__ = "sglang-ddtree CPU mode: the CUDA ops library is not loaded."
    stub._load_architecture_specific_ops = lambda: types.ModuleType("sgl_kernel_common_ops_cpu_stub")
    stub._preload_cuda_library = lambda: None
    stub._get_compute_capability = lambda: None
    return stub


def activate() -> None:
    """Install the CPU-mode import hooks (idempotent; no-op unless requested)."""
    if not cpu_engine_requested() or "sglang_ddtree.cpu.boot:active" in sys.modules:
        return
    sys.modules["sglang_ddtree.cpu.boot:active"] = types.ModuleType("marker")
    if "sgl_kernel" not in sys.modules:
        sys.modules.setdefault("sgl_kernel.load_utils", _stub_load_utils())
    if any(name in sys.modules for name in _OPS_USERS):
        _register_ops()
    else:
        sys.meta_path.insert(0, _OpsBeforeFirstUser())


# The packages that call the ops; the ops are registered before either is imported.
_OPS_USERS = ("sglang", "sgl_kernel")


class _OpsBeforeFirstUser(importlib.abc.MetaPathFinder):
    """Registers the CPU ops when the process first looks for ``sglang`` or
    ``sgl_kernel`` (before their code runs), then leaves the import to the others."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in _OPS_USERS:
            _register_ops()
        return None


def _register_ops() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _OpsBeforeFirstUser)]
    from . import ops

    ops.register_cpu_ops()
