"""The GPU jobs on the CPU: every job script and Python file parses, and the suite's account
of a run its time limit cut."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELPER = ROOT / "gpu" / "jobs" / "unfinished_tests.py"

COLLECTED = """tests/gpu_server/test_gpu_serving.py::test_a[x]
tests/gpu_server/test_gpu_serving.py::test_a[x_y]
tests/gpu_server/test_gpu_serving.py::test_b
tests/gpu_server/test_gpu_serving.py::test_c

4 tests collected in 1.21s
"""

# A run cut in test_b (SIGTERM from `timeout`): its id printed without a result, test_c never
# started, and the summary counts only what ran.
CUT_LOG = """tests/gpu_server/test_gpu_serving.py::test_a[x] PASSED [ 25%]
tests/gpu_server/test_gpu_serving.py::test_a[x_y] SKIPPED (TP-1: one rank) [ 50%]
tests/gpu_server/test_gpu_serving.py::test_b
KeyboardInterrupt: signal 15
================== 1 passed, 1 skipped in 441.11s (0:07:21) ===================
"""


def _run(tmp_path, log: str) -> subprocess.CompletedProcess:
    (tmp_path / "collected.txt").write_text(COLLECTED)
    (tmp_path / "log.txt").write_text(log)
    return subprocess.run(
        [sys.executable, str(HELPER), str(tmp_path / "collected.txt"), str(tmp_path / "log.txt")],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_cut_suite_names_the_tests_that_did_not_finish(tmp_path):
    out = _run(tmp_path, CUT_LOG)
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert lines[0] == "SUITE INCOMPLETE: 2 of 4 tests finished; not finished:"
    assert [line.strip() for line in lines[1:]] == [
        "tests/gpu_server/test_gpu_serving.py::test_b",
        "tests/gpu_server/test_gpu_serving.py::test_c",
    ]


def test_a_whole_suite_says_so(tmp_path):
    log = CUT_LOG.replace("test_b\n", "test_b FAILED [ 75%]\n") + (
        "tests/gpu_server/test_gpu_serving.py::test_c ERROR [100%]\n"
    )
    out = _run(tmp_path, log)
    assert out.returncode == 0, out.stdout
    assert out.stdout.strip() == "suite complete: 4 of 4 tests finished"


def test_every_gpu_job_script_parses():
    """A syntax error in a job would be found only on the H200, after a machine start."""
    scripts = sorted((ROOT / "gpu").rglob("*.sh"))
    assert len(scripts) >= 10
    for script in scripts:
        out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, f"{script.relative_to(ROOT)}: {out.stderr}"


def test_every_gpu_job_python_file_compiles():
    for source in sorted((ROOT / "gpu").rglob("*.py")):
        compile(source.read_text(), str(source), "exec")  # a SyntaxError names the file and line
