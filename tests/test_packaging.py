"""The wheel is the plugin: what a serving image needs, nothing of the lab, and it serves.

The wheel is built from the repository's tracked files (a stale ``build/`` folder must
not leak into it), checked for what it holds and leaves out, then installed into a
fresh environment that sees SGLang and torch but neither the checkout nor its editable
install, where a DDTREE server on the tiny models must answer exactly what the plain
reference answers.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from background import BACKGROUND
from serving import GREEDY, PROMPTS, ddtree_args, generate_sequential, reference_server, uses_reference

from lab.models.tiny import build_tiny_models
from sglang_ddtree.launch import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sglang_ddtree"
# What a serving image needs, and nothing else (README, "Layout").
SUBPACKAGES = {"adapter", "ab", "budget", "cpu", "csrc", "cuda", "kernels", "tree"}
MODULE = "test_packaging.py::"
uses_reference(f"{MODULE}test_the_wheel_serves_ddtree_in_a_fresh_environment")


def build_wheel(out: Path) -> Path:
    """The wheel of the repository's tracked files, built in a copy of them."""
    source = out / "source"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in tracked.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, source],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("sglang_ddtree-*.whl")
    return path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_the_plugin_and_nothing_of_the_lab(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    code = {n for n in names if not n.startswith("sglang_ddtree-")}
    assert all(n.startswith("sglang_ddtree/") for n in code), sorted(n for n in code if "/" in n)[:5]
    subpackages = {n.split("/")[1] for n in code if n.count("/") >= 2}
    assert subpackages == SUBPACKAGES
    assert not [n for n in names if n.endswith((".safetensors", ".bin", ".pt"))], "no model weights"
    for source in (ROOT / "cuda").glob("*.cu*"):
        assert f"sglang_ddtree/cuda/{source.name}" in names
    assert "sglang_ddtree/csrc/ddtree_cpu.cpp" in names
    for module in ("plugin.py", "adapter/worker.py", "adapter/stops.py", "kernels/gpu.py", "ab/cli.py"):
        assert f"sglang_ddtree/{module}" in names
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[sglang.srt.plugins]" in text and "ddtree = sglang_ddtree.plugin:register" in text


def test_every_subpackage_is_listed():
    """A folder with an ``__init__.py`` missing from pyproject's package list is left out of
    the wheel without a word."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in PACKAGE.rglob("__init__.py")}
    assert found - listed == set()


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            names.add(".".join([*base, node.module] if node.module else base))
    return names


def test_the_package_never_imports_the_lab():
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            n for n in _imported_modules(path) if n.split(".")[0] in ("lab", "tests")
        )
        for path in PACKAGE.rglob("*.py")
    }
    assert {path: names for path, names in offenders.items() if names} == {}
    # and the check sees an import of the lab where there is one
    assert "lab.models.tiny" in _imported_modules(ROOT / "lab" / "ab_tiny.py")


def _fresh_environment(root: Path, wheel: Path) -> Path:
    """A virtual environment that sees this one's packages (SGLang, torch) through a path
    entry - not as a site folder, so the checkout's editable install and CPU hook stay out -
    with the wheel installed into it and the CPU hook installed from it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", root], check=True)
    python = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "outside.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", site, wheel]
    subprocess.run(pip, check=True, capture_output=True)
    subprocess.run([python, "-m", "sglang_ddtree.cpu", "install-hook"], check=True, capture_output=True)
    return python


def _serve_from_the_wheel(job) -> dict:
    """In the background of the run (tests/background.py): the wheel installed into a fresh
    environment, where a DDTREE server on the tiny models answers the greedy prompts."""
    python = _fresh_environment(job.folder / "venv", build_wheel(job.folder))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout stays out of reach
    where = subprocess.run(
        [python, "-c", "import sglang_ddtree; print(sglang_ddtree.__file__)"],
        cwd=job.folder,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    server = ServerProcess(
        ddtree_args(build_tiny_models(), budget=8, extra=["--log-level", "info"]),
        log_path=job.folder / "wheel-ddtree.log",
        start_timeout=900.0,
        name="wheel-ddtree",
        python=str(python),
        cwd=job.folder,
    )
    server.env = env
    job.track(server.launch().group)  # stopped by the end of the run too, should this job outlive it
    with server:
        outputs = generate_sequential(server, PROMPTS[:3], GREEDY)
        budget = server.server_info()["ddtree"]["budget"]
    return {"module": where, "outputs": outputs, "budget": budget, "log": server.log_path.read_text()}


BACKGROUND.declare(
    "wheel-serves", f"{MODULE}test_the_wheel_serves_ddtree_in_a_fresh_environment", _serve_from_the_wheel
)


@pytest.mark.server
def test_the_wheel_serves_ddtree_in_a_fresh_environment(servers):
    served = BACKGROUND.result("wheel-serves")
    assert served["module"].startswith(str(BACKGROUND.job("wheel-serves").folder / "venv")), served["module"]
    expected = generate_sequential(reference_server(servers, build_tiny_models()), PROMPTS[:3], GREEDY)
    assert served["outputs"] == expected
    assert served["budget"] == 8
    assert "DDTREE worker ready" in served["log"]


# Modules that touch the environment for another reason than reading a setting, and why.
ENVIRONMENT_ELSEWHERE = {
    "sglang_ddtree/launch.py": "hands the caller's environment to the processes it starts",
    "sglang_ddtree/cpu/hook.py": "the start-up hook's line is text written to a .pth file",
    # a client, not the plugin: it starts servers with environments of their own, reports the
    # DDTREE variables they inherit, and stamps $BENCH_COMMIT for copies without .git
    "sglang_ddtree/ab/": "the A/B tool",
}


def _environment_uses(path: Path) -> tuple[list[int], list[int]]:
    """Lines of ``path`` that read the environment, and lines that write it."""
    reads, writes = [], []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                (writes if node.attr in ("putenv", "unsetenv") else reads).append(node.lineno)
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Subscript) and "environ" in ast.unparse(target.value):
                writes.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if "environ" in ast.unparse(node.func.value) and node.func.attr in (
                "update",
                "setdefault",
                "pop",
            ):
                writes.append(node.lineno)
    return reads, writes


def test_the_package_reads_its_environment_in_one_module_and_writes_none(tmp_path):
    """Settings are parsed once and passed by argument (config.Settings); the debugging and
    test variables are read in config.py alone; nothing writes the environment."""
    found = {str(p.relative_to(ROOT)): _environment_uses(p) for p in PACKAGE.rglob("*.py")}
    assert {path: writes for path, (_, writes) in found.items() if writes} == {}
    readers = {path for path, (reads, _) in found.items() if reads}
    elsewhere = {path for path in readers if any(path.startswith(place) for place in ENVIRONMENT_ELSEWHERE)}
    assert readers - elsewhere == {"sglang_ddtree/config.py"}
    # the scan sees a write where there is one
    (sample := tmp_path / "environment_sample.py").write_text(
        "import os\nos.environ['X'] = '1'\nos.environ.setdefault('Y', '2')\n"
    )
    assert _environment_uses(sample)[1] == [2, 3]
