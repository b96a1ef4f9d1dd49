"""The ``.pth`` start-up hook that makes CPU mode reach SGLang's subprocesses.

SGLang's scheduler processes import ``sgl_kernel`` long before they run any
plugin code, so the stand-in for its CUDA library must be installed at
interpreter start. A ``.pth`` file in site-packages does that for every Python
process of the environment; it does nothing unless ``SGLANG_USE_CPU_ENGINE=1``.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

PTH_NAME = "sglang_ddtree_cpu.pth"
PTH_LINE = (
    "import os; os.environ.get('SGLANG_USE_CPU_ENGINE', '').strip().lower() in ('1', 'true', 'yes', 'on') "
    "and __import__('sglang_ddtree.cpu.boot', fromlist=['activate']).activate()\n"
)


def hook_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def install_hook() -> Path:
    path = hook_path()
    path.write_text(PTH_LINE)
    return path


def remove_hook() -> bool:
    path = hook_path()
    if path.exists():
        path.unlink()
        return True
    return False


def hook_active() -> bool:
    import sys

    return "sglang_ddtree.cpu.boot:active" in sys.modules
