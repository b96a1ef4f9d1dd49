"""The GPU jobs on the CPU: every job script and Python file parses, and the suite's account
of a run its time limit cut."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

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


def _tar_xz(path: Path, files: dict[str, str]) -> None:
    import io

    with tarfile.open(path, "w:xz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _names(path: Path) -> set[str]:
    with tarfile.open(path, "r:xz") as tar:
        return {m.name.removeprefix("./") for m in tar.getmembers() if m.isfile()}


def _device_sh(tmp_path: Path, out: Path, job: str) -> subprocess.CompletedProcess:
    """gpu/device.sh in a copy of the repository with a fake bundle and caches carried."""
    repo = tmp_path / "repo"
    if not repo.exists():
        (repo / "gpu").mkdir(parents=True)
        for script in ("device.sh", "xz.sh"):  # device.sh and the helper it sources
            (repo / "gpu" / script).write_text((ROOT / "gpu" / script).read_text())
        carry = repo / ".carry" / "gpu"
        carry.mkdir(parents=True)
        _tar_xz(carry / "site-fake.tar.xz", {"marker.py": ""})
        _tar_xz(carry / "cache-fake.tar.xz", {"./jit/marlin.so": "jit", MARLIN_KERNEL: "marlin"})
        _tar_xz(carry / "triton-fake.tar.xz", {"./triton/old/k.cubin": "old"})
    env = {
        # the test's Python first: device.sh unpacks with python3's lzma where there is no xz
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "SGLANG_VERSION": "fake",
        "OUT": str(out),
        "DEVICE_SITE_DIR": str(tmp_path / f"site-{out.name}"),
        "DEVICE_CACHE_DIR": str(tmp_path / f"cache-{out.name}"),
    }
    return subprocess.run(
        ["bash", str(repo / "gpu" / "device.sh"), "bash", "-c", job],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


MARLIN_KERNEL = "./jit/sm90a/sgl_kernel_jit_moe_wna16_marlin_bf16_t/k.so"  # the K2.6 rank's, carried apart

# The job sees both carried caches and compiles one more Triton kernel.
COMPILES = (
    'test -f "$SGLANG_JIT_CACHE_DIR/marlin.so" && test -f "$TRITON_CACHE_DIR/old/k.cubin"'
    ' && mkdir -p "$TRITON_CACHE_DIR/new" && echo new > "$TRITON_CACHE_DIR/new/k.cubin"'
)


def test_device_sh_carries_the_jit_marlin_and_triton_caches_in_three_files(tmp_path):
    """The K2.6 rank's Marlin kernels go into a file of their own (only its calls carry them:
    the working tree and the carry share 64 MiB), and only when the call did not carry them."""
    out = tmp_path / "out"
    run = _device_sh(tmp_path, out, COMPILES)
    assert run.returncode == 0, run.stdout + run.stderr
    assert _names(out / "cache-fake.tar.xz") == {"jit/marlin.so"}
    assert _names(out / "marlin-fake.tar.xz") == {MARLIN_KERNEL.removeprefix("./")}
    assert _names(out / "triton-fake.tar.xz") == {"triton/old/k.cubin", "triton/new/k.cubin"}
    (tmp_path / "repo" / ".carry" / "gpu" / "marlin-fake.tar.xz").write_bytes(
        (out / "marlin-fake.tar.xz").read_bytes()
    )
    again = tmp_path / "again"
    run = _device_sh(tmp_path, again, COMPILES)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not (again / "marlin-fake.tar.xz").exists()  # carried: nothing new to bring back


def test_device_sh_leaves_tritons_cache_out_when_the_job_fills_the_files(tmp_path):
    """A call brings back 8 files: seven of the job's and the JIT caches leave no room."""
    out = tmp_path / "full"
    run = _device_sh(
        tmp_path, out, COMPILES + ' && for i in 1 2 3 4 5 6 7; do echo > "$OUT/f$i"; done; exit 3'
    )
    assert run.returncode == 3  # the job's status
    assert (out / "cache-fake.tar.xz").exists() and not (out / "triton-fake.tar.xz").exists()
    assert not (out / "marlin-fake.tar.xz").exists() and "Marlin's kernels not saved" in run.stdout
    assert "Triton's cache not saved" in run.stdout


def test_take_caches_recompresses_what_a_call_brought_back_into_the_carry(tmp_path):
    files_at, carry = tmp_path / "files_at", tmp_path / "carry"
    files_at.mkdir()

    def take() -> subprocess.CompletedProcess:
        run = subprocess.run(
            ["bash", str(ROOT / "gpu" / "take_caches.sh"), str(files_at)],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "SGLANG_VERSION": "fake", "CARRY_DIR": str(carry)},
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        return run

    _tar_xz(files_at / "cache-fake.tar.xz", {"./jit/marlin.so": "jit" * 1000, "./cupy/k.cubin": "cubin"})
    _tar_xz(files_at / "triton-fake.tar.xz", {"./triton/k/k.cubin": "triton"})
    _tar_xz(files_at / "marlin-fake.tar.xz", {MARLIN_KERNEL: "marlin"})
    run = take()
    assert _names(carry / "cache-fake.tar.xz") == {"jit/marlin.so", "cupy/k.cubin"}
    assert _names(carry / "triton-fake.tar.xz") == {"triton/k/k.cubin"}
    assert _names(carry / "marlin-fake.tar.xz") == {MARLIN_KERNEL.removeprefix("./")}
    assert "of 64 MiB" in run.stdout
    # a call that carried no Triton cache brings back only its own few kernels: the carry keeps its own
    _tar_xz(files_at / "triton-fake.tar.xz", {"./triton/other/k.cubin": "rank"})
    _tar_xz(carry / "triton-fake.tar.xz", {"./triton/k/k.cubin": "pair", "./triton/j/j.cubin": "pair"})
    run = take()
    assert _names(carry / "triton-fake.tar.xz") == {"triton/k/k.cubin", "triton/j/j.cubin"}
    assert "triton: kept the carried file (2 entries; the call's had 1)" in run.stdout


def test_timed_tests_names_what_its_time_limit_cut(tmp_path):
    """The jobs' shared runner (gpu/jobs/kernel_tests.sh, ``timed_tests``) on real pytest runs:
    a whole run ends its log with "suite complete", one its limit cut names the rest."""
    (tmp_path / "test_x.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(60)\n\ndef test_after():\n    pass\n"
    )
    script = ROOT / "gpu" / "jobs" / "kernel_tests.sh"

    def timed(seconds: int, select: str) -> str:
        log = tmp_path / f"log_{seconds}.txt"
        subprocess.run(
            ["bash", "-c", f'source "{script}"; timed_tests {seconds} "{log}" -p no:cacheprovider {select}'],
            cwd=tmp_path,  # as the jobs run: test ids relative to the folder pytest runs in
            env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
            timeout=120,
            check=True,
        )
        return log.read_text()

    whole = timed(60, "test_x.py -k 'quick or after'")
    assert whole.rstrip().endswith("suite complete: 2 of 2 tests finished"), whole
    cut = timed(20, "test_x.py")  # room for pytest to start on a loaded machine
    tail = cut[cut.index("SUITE INCOMPLETE") :].splitlines()
    assert tail[0] == "SUITE INCOMPLETE: 1 of 3 tests finished; not finished:", cut
    assert [line.strip().rsplit("::", 1)[-1] for line in tail[1:]] == ["test_slow", "test_after"]


def _dry_job(tmp_path, job: str, **env) -> str:
    """A GPU job on the CPU with ``python`` stubbed: its A/B tool call runs for real with
    ``--dry-run`` (nothing starts; every arm's flags go through SGLang's own parser), every other
    python call (pytest, the GPU check) and ``nvidia-smi`` just succeed. Its output."""
    stubs, out = tmp_path / "bin", tmp_path / "out"
    stubs.mkdir(parents=True)
    out.mkdir()
    (stubs / "python").write_text(
        f'#!/bin/sh\ncase "$*" in "-m sglang_ddtree.ab "*) exec {sys.executable} "$@" --dry-run;; esac\nexit 0\n'
    )
    (stubs / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    run = subprocess.run(
        ["bash", f"gpu/jobs/{job}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, **env, "OUT": str(out), "PATH": f"{stubs}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every arm's parse" in run.stdout, run.stdout + run.stderr
    return run.stdout


def test_ab_pair_gives_the_width1_arm_its_cost_table(tmp_path):
    arms = "plain,ddtree@auto64,ddtree@auto64+width1,ddtree@32,ddtree@32+phases,ddtree@32+heapq,dflash+again,dflash"
    out = _dry_job(tmp_path, "ab_pair.sh", ARMS=arms, AB_ARGS="--profile dflash@1,ddtree@32@16")
    table = f"SGLANG_DDTREE_BUDGET_COST_TABLE={ROOT}/gpu/jobs/width1_cost_table_auto64.json"
    text = out.splitlines()  # the dry run: "[arm] what it serves", then its environment and command
    lines = {line[1 : line.index("]")]: text[i + 1] for i, line in enumerate(text) if line.startswith("[")}
    assert table in lines["ddtree@auto64+width1"] and table not in lines["ddtree@auto64"]
    assert "SGLANG_DDTREE_PHASE_TIMES=50" in lines["ddtree@32+phases"]
    heapq = "SGLANG_DDTREE_TREE_BACKEND=python"
    assert heapq in lines["ddtree@32+heapq"] and heapq not in lines["ddtree@32"] + lines["ddtree@32+phases"]
    assert "schedule interleaved" in out and "profile: ddtree@32 at c=16" in out
    assert "COST_TABLE" not in _dry_job(tmp_path / "default", "ab_pair.sh")  # only where the arm runs


def test_ab_width1_pairs_the_step_with_the_package_before_it(tmp_path):
    """``BEFORE_DIR``: the width-1-only arm served again from another copy of the package (its
    PYTHONPATH first), with the base arm's cost table, in the same interleaved run."""
    before = tmp_path / "before"
    (before / "sglang_ddtree").mkdir(parents=True)
    out = _dry_job(tmp_path / "job", "ab_width1.sh", BEFORE_DIR=str(before), TIMED="0", FRAME="0", PROFILE="")
    text = out.splitlines()
    lines = {line[1 : line.index("]")]: text[i + 1] for i, line in enumerate(text) if line.startswith("[")}
    assert f"PYTHONPATH={before}:{ROOT}" in lines["ddtree@auto64+before"]
    assert "SGLANG_DDTREE_BUDGET_COST_TABLE=" in lines["ddtree@auto64+before"]
    assert "PYTHONPATH" not in lines["ddtree@auto64"]


@pytest.mark.parametrize("budget", [64, 7])
def test_the_width1_table_makes_every_step_width_1(budget):
    """gpu/jobs/width1_cost_table_auto{64,7}.json (the pair's and the K2.6 rank's online budget):
    the candidates of ddtree@auto<budget>, and width 1 far cheaper than any tree at every batch
    size, so the chooser picks it even for a confident prediction (a width-1 step runs no
    drafter: the fallback to no speculation)."""
    import json

    import numpy as np

    from sglang_ddtree.adapter.widths import StepWidths
    from sglang_ddtree.budget import RoundCostTable, candidate_widths
    from sglang_ddtree.config import budget_cost_table

    path = ROOT / "gpu" / "jobs" / f"width1_cost_table_auto{budget}.json"
    with pytest.MonkeyPatch.context() as monkey:
        monkey.setenv("SGLANG_DDTREE_BUDGET_COST_TABLE", str(path))
        table = budget_cost_table()
    assert tuple(table["widths"]) == candidate_widths(budget) and table == json.loads(path.read_text())
    cost = RoundCostTable(table["batch_sizes"], table["widths"], table["ms"])
    widths = StepWidths(candidate_widths(budget), cost, depth=7, make_head=lambda w: w)
    widths.expected.per_request = np.full((len(widths.widths), 7), 0.9)  # a confident prediction
    assert all(widths.chooser.choose(bs, widths.expected.of_batch(bs)) == 1 for bs in (1, 8, 64, 300))


def test_tp2_runs_the_ab_tool_at_tp2_beside_the_suite(tmp_path):
    out = _dry_job(tmp_path, "tp2.sh")
    assert "--tp 2" in out and "--nccl-port 24203" in out and "schedule interleaved" in out
    assert "profile: ddtree@32 at c=8, 10 steps" in out
    assert "the first pass waits for /tmp/ddtree-tp2-suite-done" in out
    assert "series pycode-4l_h200x2_tp2_ab" in out
    # the series names the GPU the call got (gpu/device.sh's DEVICE_NAME), not the kind asked for
    assert "series pycode-4l_h100x2_tp2_ab" in _dry_job(tmp_path / "h100", "tp2.sh", DEVICE_NAME="h100")
    assert (tmp_path / "out" / "tp2_logs.tar.gz").exists()


TWO_GPUS = ROOT / "gpu" / "jobs" / "two_gpus.sh"


def _two_gpus(tmp_path, *jobs: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OUT": str(tmp_path), "GPUS": "3 5", "TAIL_LINES": "5"}
    return subprocess.Popen(
        ["bash", str(TWO_GPUS), *jobs],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def test_two_gpus_runs_each_job_on_its_gpu_into_one_archive(tmp_path):
    import tarfile

    job = 'echo "gpu $CUDA_VISIBLE_DEVICES results $GPU_RESULTS_DIR"; echo {} > "$OUT/{}.json"; exit {}'
    proc = _two_gpus(tmp_path, "suite", job.format(1, "s", 0), "k26", job.format(2, "k", 3))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out  # the second job's failure is the call's
    assert "suite exited with 0, k26 with 3" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k26.tar", "suite.tar"]  # two files come back
    with tarfile.open(tmp_path / "k26.tar") as tar:
        assert sorted(tar.getnames()) == ["k26", "k26/k.json", "k26/k26.log"]
        log = tar.extractfile("k26/k26.log").read().decode()
    assert log.strip() == f"gpu 5 results {tmp_path}/k26"


def test_two_gpus_stops_both_jobs_when_stopped(tmp_path):
    import signal
    import time

    marker = f"sleep {os.getpid() % 1000 + 7000}"
    proc = _two_gpus(tmp_path, "a", f"bash -c '{marker}; true'", "b", f"{marker}.5")
    try:
        deadline = time.time() + 30
        while len(_pids_running(marker)) < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert len(_pids_running(marker)) == 2
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.time() + 10
        while _pids_running(marker) and time.time() < deadline:
            time.sleep(0.2)
        assert _pids_running(marker) == []
    finally:
        for pid in _pids_running(marker):
            os.kill(pid, signal.SIGKILL)


def _pids_running(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"^{marker}"], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


def test_two_gpus_refuses_one_name_twice(tmp_path):
    proc = _two_gpus(tmp_path, "a", "true", "a", "true")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "two different names" in out


def test_the_gpu_width1_arm_keeps_the_devices_plugins_and_adds_the_decode_check(monkeypatch):
    """The device command loads its own test plugins (``lab.gpu_compat``: the float32 RMSNorm);
    the width-1 arm's decode check must come after them, not replace them (a server without
    them cannot start in float32)."""
    from tests.gpu_server.arms import arm_env

    monkeypatch.setenv("SGLANG_DDTREE_TEST_PLUGIN", "lab.gpu_compat")
    env = arm_env("ddtree_fp32_graphs_auto_width1")
    assert env["SGLANG_DDTREE_TEST_PLUGIN"] == "lab.gpu_compat,decode_check_plugin"
    tests_dir = str(Path(__file__).resolve().parent)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == tests_dir
    monkeypatch.delenv("SGLANG_DDTREE_TEST_PLUGIN")
    assert arm_env("ddtree_fp32_graphs_auto_width1")["SGLANG_DDTREE_TEST_PLUGIN"] == "decode_check_plugin"
    assert "SGLANG_DDTREE_TEST_PLUGIN" not in arm_env("ddtree_fp32_graphs_auto")


def test_a_killed_suite_s_loose_server_logs_are_packed_into_one_file(tmp_path):
    logs = tmp_path / "gpu_server_logs"
    logs.mkdir()
    for arm in ("plain_fp32", "ddtree_fp32_graphs"):
        (logs / f"{arm}.log").write_text(f"{arm} started\n")
    script = f'source "{ROOT}/gpu/jobs/kernel_tests.sh" && pack_server_logs && pack_server_logs'
    out = subprocess.run(
        ["bash", "-c", script],
        env={**os.environ, "GPU_RESULTS_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_server_logs.tar.gz"]
    with tarfile.open(tmp_path / "gpu_server_logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == [
            "gpu_server_logs",
            "gpu_server_logs/ddtree_fp32_graphs.log",
            "gpu_server_logs/plain_fp32.log",
        ]


def test_a_run_of_part_of_the_suite_skips_the_arms_it_left_out(tmp_path):
    """GPU_SERVER_ARMS names some arms: a test of another arm skips (its log too), while a test
    of an arm that was asked for and did not start fails."""
    from tests.gpu_server.arms import Fleet

    fleet = Fleet(tmp_path)
    with pytest.raises(pytest.skip.Exception, match="plain_fp32 not started"):
        fleet["plain_fp32"]
    with pytest.raises(pytest.skip.Exception):
        fleet.log_text("plain_fp32")
    fleet.errors["ddtree_fp32_graphs"] = "out of memory"
    with pytest.raises(RuntimeError, match="did not start:\nout of memory"):
        fleet["ddtree_fp32_graphs"]


def test_a_server_that_lost_a_memory_race_starts_again_alone(tmp_path, monkeypatch):
    """Seven servers starting at once on an 80 GB card: one read the free memory while another
    allocated and failed "no GPU memory for the KV cache". The fleet starts it again once the
    wave is up; any other start failure stands."""
    from tests.gpu_server import arms

    tries = []

    class FakeServer:
        def __init__(self, args, env, log_path, start_timeout, name):
            self.name = name

        def start(self):
            tries.append(self.name)
            if self.name == "plain_fp32":
                raise arms.ServerStartError("CUDA error: an illegal memory access")
            if self.name == "ddtree_fp32_eager_auto" and tries.count(self.name) == 1:
                raise arms.ServerStartError(
                    "ValueError: Loaded weights leave no GPU memory for the KV cache under "
                    "--mem-fraction-static=0.05."
                )
            return self

    monkeypatch.setattr(arms, "ServerProcess", FakeServer)
    fleet = arms.Fleet(tmp_path)
    for arm in ("ddtree_fp32_eager_auto", "plain_fp32", "ddtree_fp32_graphs"):
        fleet.start(arm)
    assert sorted(fleet.errors) == ["ddtree_fp32_eager_auto", "plain_fp32"]
    assert fleet.restart_memory_races() == ["ddtree_fp32_eager_auto"]
    assert fleet["ddtree_fp32_eager_auto"].name == "ddtree_fp32_eager_auto"
    assert tries.count("ddtree_fp32_eager_auto") == 2 and tries.count("plain_fp32") == 1
    with pytest.raises(RuntimeError, match="illegal memory access"):
        fleet["plain_fp32"]


@pytest.mark.parametrize("has_xz", [True, False], ids=["xz", "python-lzma"])
def test_an_a_b_run_s_logs_come_back_as_one_xz_tarball_without_the_torch_traces(tmp_path, has_xz):
    raw = tmp_path / "ab_pair_raw"
    raw.mkdir()
    (raw / "server_plain.log").write_text("plain ready\n" * 200)
    (raw / "bench_plain_c1_r0.log").write_text("pass 1\n")
    (raw / "plain_c1.trace.json.gz").write_bytes(b"a torch trace")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out)}
    if not has_xz:  # the device image may lack xz: only what the function needs besides it
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for tool in ("tar", "stat", "dirname", "basename", "rm"):
            (bin_dir / tool).symlink_to(shutil.which(tool))
        (bin_dir / "python3").symlink_to(sys.executable)
        env["PATH"] = str(bin_dir)
    script = f'source "{ROOT}/gpu/jobs/ab_logs.sh" && bring_back_logs "{raw}" pycode-4l_cpu_ab'
    bash = shutil.which("bash")
    done = subprocess.run([bash, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in out.iterdir()] == ["pycode-4l_cpu_ab_logs.tar.xz"]
    with tarfile.open(out / "pycode-4l_cpu_ab_logs.tar.xz", "r:xz") as tar:
        assert sorted(tar.getnames()) == [
            "ab_pair_raw",
            "ab_pair_raw/bench_plain_c1_r0.log",
            "ab_pair_raw/server_plain.log",
        ]
        assert tar.extractfile("ab_pair_raw/server_plain.log").read() == b"plain ready\n" * 200
