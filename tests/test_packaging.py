"""A non-editable wheel carries the CUDA and C++ sources, the trained pair and the
plugin entry point."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contents(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("sglang_ddtree-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in (ROOT / "cuda").glob("*.cu*"):
        assert f"sglang_ddtree/cuda/{source.name}" in names
    assert "sglang_ddtree/csrc/ddtree_cpu.cpp" in names
    assert "sglang_ddtree/models/pairs/pycode-4l/drafter/model.safetensors" in names
    for module in ("plugin.py", "adapter/worker.py", "adapter/attention/torch_native.py", "kernels/gpu.py"):
        assert f"sglang_ddtree/{module}" in names
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[sglang.srt.plugins]" in text and "ddtree = sglang_ddtree.plugin:register" in text


def test_every_subpackage_is_listed():
    """A folder with an ``__init__.py`` missing from pyproject's package list is left out of
    the wheel without a word (as ``bench/ab`` would be)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    package = ROOT / "sglang_ddtree"
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in package.rglob("__init__.py")}
    assert found - listed == set()
