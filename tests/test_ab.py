"""The A/B tool (``python -m sglang_ddtree.ab``) end to end on the tiny models:
a two-arm smoke run writes a report with numbers for both arms and leaves no server
behind; a server that fails to start, and an interrupted run, end with a clear error
and no process left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from background import BACKGROUND
from processes import LOAD_GENERATOR_MARKS, RUN_TAG_ENV, kill_all, tagged_processes, wait_none_left

from sglang_ddtree.launch import live_group_members

AB = [sys.executable, "-m", "lab.ab_tiny"]
SMALL = ["--concurrency", "1", "--num-prompts", "4", "--input-len", "32", "--output-len", "16"]
SMALL += ["--check-prompts", "2", "--check-tokens", "16", "--start-timeout", "900"]


def _procs_with(*needles: str) -> list[str]:
    """Command lines of running processes that contain every needle."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd and all(n in cmd for n in needles):
            found.append(f"{entry.name}: {cmd[:300]}")
    return found


def _assert_nothing_left(report: dict) -> None:
    for arm in report["arms"]:
        if arm["port"] is not None:
            port = str(arm["port"])
            assert not _procs_with("sglang.launch_server", f"--port {port}"), (
                f"{arm['name']} server still runs"
            )
            assert not _procs_with("serving", f"127.0.0.1:{port}"), (
                f"a load generator for {arm['name']} still runs"
            )
        if arm["pid"] is not None:
            assert live_group_members(arm["pid"]) == [], f"{arm['name']}'s process group still has members"
    assert report["servers_left_running"] == []


def _one_report(out: Path) -> tuple[dict, Path]:
    reports = sorted(out.glob("ab_*.json"))
    assert len(reports) == 1, f"expected one JSON report in {out}, found {reports}"
    return json.loads(reports[0].read_text()), reports[0]


def _interruptible():
    # A run started in the background of a non-interactive shell (`make test &`, a CI
    # runner's script) inherits SIGINT ignored, and Python then never raises
    # KeyboardInterrupt: the tool is started with Ctrl-C's default action, as at a terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _popen_tool(folder: Path, args: list[str], env=None) -> subprocess.Popen:
    """The tool, its output in ``folder`` (files: a pipe nobody reads could fill up)."""
    folder.mkdir(exist_ok=True)
    with (folder / "stdout.txt").open("w") as stdout, (folder / "stderr.txt").open("w") as stderr:
        return subprocess.Popen(
            [*AB, *args], stdout=stdout, stderr=stderr, env=env, preexec_fn=_interruptible
        )


def _outputs(folder: Path) -> tuple[str, str]:
    return (folder / "stdout.txt").read_text(), (folder / "stderr.txt").read_text()


def _reports(folder: Path) -> list[str]:
    return ["--out-dir", str(folder / "reports"), "--raw-dir", str(folder / "raw")]


# The tool's runs are background jobs (tests/background.py): each is the tool's and its
# servers' start-ups, mostly on one core, while other tests run; the tests read them.
def _run_to_end(job, args: list[str]) -> tuple[int, float]:
    started = time.monotonic()
    proc = job.track(_popen_tool(job.folder, [*args, *_reports(job.folder)]))
    returncode = proc.wait(timeout=900)
    return returncode, time.monotonic() - started


def _smoke_run(job):
    return _run_to_end(job, ["--arms", "ddtree,plain", *SMALL])


def _failing_run(job):
    """A run whose ddtree arm's server cannot start (an unknown flag)."""
    return _run_to_end(
        job, ["--arms", "ddtree,plain", "--arm-args", "ddtree=--no-such-flag-for-the-ab-test", *SMALL]
    )


BACKGROUND.declare("ab-smoke", "test_ab.py::test_ab_smoke_two_arms", _smoke_run)
BACKGROUND.declare("ab-start-failure", "test_ab.py::test_ab_server_start_failure_is_reported", _failing_run)


@pytest.mark.server
def test_ab_smoke_two_arms():
    job = BACKGROUND.job("ab-smoke")
    returncode, elapsed = BACKGROUND.result("ab-smoke")
    stdout, stderr = _outputs(job.folder)
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    report, path = _one_report(job.folder / "reports")
    stem = path.with_suffix("")
    for suffix in (".md", ".png"):
        assert stem.with_suffix(suffix).is_file(), f"missing {stem.with_suffix(suffix)}"
    assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert report["status"] == "ok" and report["error"] is None
    rows = {r["arm"]: r for r in report["summary"]}
    assert set(rows) == {"ddtree", "plain"}
    for name, row in rows.items():
        assert row["concurrency"] == 1 and row["completed"] == 4, row
        for key in ("output_tok_s", "median_tpot_ms", "median_ttft_ms", "vs_baseline"):
            assert isinstance(row[key], float) and row[key] > 0, (name, key, row[key])
    assert rows["plain"]["vs_baseline"] == pytest.approx(1.0)
    assert rows["plain"]["accept_length"] is None
    assert rows["ddtree"]["accept_length"] >= 1.0  # bonus token at least, every round
    assert report["greedy_check"]["ok"] and report["greedy_check"]["arms_checked"] == ["ddtree", "plain"]
    assert report["parity"]["arms_read"] == ["ddtree", "plain"]
    assert report["winners"] and report["winners"][0]["winner"] in rows
    assert report["stamp"]["versions"]["sglang"] and report["stamp"]["commit"]
    ddtree = next(a for a in report["arms"] if a["name"] == "ddtree")
    assert "--speculative-ddtree-budget 16" in ddtree["launch_command"]

    md = stem.with_suffix(".md").read_text()
    for name, row in rows.items():
        assert f"| {name} | 1 | 4 | {row['output_tok_s']:.1f} |" in md
    assert "identical token ids" in md
    _assert_nothing_left(report)
    print(f"A/B smoke run: {elapsed:.0f} s")


@pytest.mark.server
def test_ab_server_start_failure_is_reported():
    job = BACKGROUND.job("ab-start-failure")
    returncode, _ = BACKGROUND.result("ab-start-failure")
    stdout, stderr = _outputs(job.folder)
    assert returncode == 2, stdout[-3000:] + stderr[-3000:]
    assert "the 'ddtree' arm's server did not start" in stderr
    assert "--- last lines of" in stderr  # the server log's tail
    assert "--no-such-flag-for-the-ab-test" in stderr.split("--- last lines of", 1)[1]
    report, _ = _one_report(job.folder / "reports")
    assert report["status"] == "failed" and "did not start" in report["error"]
    arms = {a["name"]: a for a in report["arms"]}
    assert arms["ddtree"]["port"] is not None and arms["ddtree"]["error"]
    assert arms["plain"]["port"] is None, "the run went on after an arm failed"
    _assert_nothing_left(report)


def _loaded_run_tag(folder: Path) -> str:
    return f"ab-{folder.name}-{os.getpid()}"


def _launch_loaded_run(job) -> subprocess.Popen:
    """The A/B tool with a long load to run (plain arm first); its processes carry
    their own tag, which the test checks."""
    many = ["--concurrency", "1", "--num-prompts", "200", "--output-len", "64", "--check-prompts", "1"]
    args = ["--arms", "plain,ddtree", *many, "--start-timeout", "900", *_reports(job.folder)]
    env = {**os.environ, RUN_TAG_ENV: _loaded_run_tag(job.folder)}
    return job.track(_popen_tool(job.folder, args, env=env))


def _wait_for_load(proc: subprocess.Popen, folder: Path) -> None:
    """Until the tool's first server is up and a load generator runs."""
    deadline = time.monotonic() + 900
    while not list((folder / "raw").glob("bench_*.log")):
        if proc.poll() is not None:
            raise AssertionError(_outputs(folder))
        assert time.monotonic() < deadline, "the load never started"
        time.sleep(1)
    while not tagged_processes(_loaded_run_tag(folder), marks=LOAD_GENERATOR_MARKS):
        assert proc.poll() is None and time.monotonic() < deadline, "the load generator never ran"
        time.sleep(0.5)


def _interrupted_run(job) -> int:
    """The tool interrupted (SIGINT) while its load runs; its exit code."""
    proc = _launch_loaded_run(job)
    try:
        _wait_for_load(proc, job.folder)
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=900)  # no short limit: a loaded machine stops slowly
    finally:
        if proc.poll() is None:
            proc.kill()  # the watchdogs stop what it started
            proc.wait()


def _killed_run(job) -> dict[int, str]:
    """The tool SIGKILLed while its load runs; what it had started (by tag)."""
    proc = _launch_loaded_run(job)
    try:
        _wait_for_load(proc, job.folder)
        return tagged_processes(_loaded_run_tag(job.folder))
    finally:
        proc.kill()
        proc.wait()


BACKGROUND.declare("ab-interrupt", "test_ab.py::test_ab_interrupt_stops_everything", _interrupted_run)
BACKGROUND.declare("ab-sigkill", "test_ab.py::test_ab_sigkill_leaves_nothing_behind", _killed_run)


def _assert_no_process_left(tag: str) -> None:
    # Generous: on a loaded machine a SIGKILLed group can take a while to be reaped.
    left = wait_none_left(tag, timeout=300)
    kill_all(left)
    assert not left, f"processes left running: {left}"


@pytest.mark.server
def test_ab_interrupt_stops_everything():
    job = BACKGROUND.job("ab-interrupt")
    returncode = BACKGROUND.result("ab-interrupt")
    _assert_no_process_left(_loaded_run_tag(job.folder))
    stdout, stderr = _outputs(job.folder)
    assert returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert "interrupted" in stderr
    report, _ = _one_report(job.folder / "reports")
    assert report["status"] == "interrupted"
    assert report["arms"][0]["port"] is not None and report["arms"][1]["port"] is None
    _assert_nothing_left(report)


@pytest.mark.server
def test_ab_sigkill_leaves_nothing_behind():
    """No clean-up code runs in a SIGKILLed tool: its server (scheduler included)
    and load generator must still go, by parent-death signal and watchdog."""
    job = BACKGROUND.job("ab-sigkill")
    started = BACKGROUND.result("ab-sigkill")
    assert any("sglang::scheduler" in cmd or "launch_server" in cmd for cmd in started.values()), started
    _assert_no_process_left(_loaded_run_tag(job.folder))


# --------------------------------------------------------------------------- no server: the report logic


def _fake_run_arm(greedy_by_arm: dict, readback_by_arm: dict | None = None):
    """A stand-in for ``run_arm`` that fills an arm as a finished run would."""

    def run_arm(arm, opts, plan, raw, pbar, live):
        arm.port, arm.pid, arm.start_seconds, arm.stopped = 1, None, 0.0, True
        arm.readback = {"disable_overlap_schedule": False, "cuda_graph_config.decode.max_bs": 64}
        arm.readback.update((readback_by_arm or {}).get(arm.name, {}))
        arm.greedy = greedy_by_arm[arm.name]
        speed = {"plain": 100.0, "chain": 150.0}.get(arm.name, 200.0)
        for concurrency, num_prompts, rep in plan:
            arm.runs.append(
                {
                    "completed": num_prompts,
                    "output_throughput": speed + rep,
                    "median_tpot_ms": 1000.0 / speed,
                    "median_ttft_ms": 10.0,
                    "p99_ttft_ms": 20.0,
                    "median_itl_ms": 5.0,
                    "accept_length": None if arm.kind == "plain" else 3.0,
                    "concurrency_requested": concurrency,
                    "num_prompts": num_prompts,
                    "repeat": rep,
                }
            )

    return run_arm


FAKE = ["--model", "/nonexistent/target", "--drafter", "/nonexistent/drafter", "--chain-impl", "dflash"]
FAKE += ["--concurrency", "1,4", "--num-prompts", "8", "--repeats", "2", "--check-prompts", "2", "--no-plot"]


def test_report_winners_and_ratios(tmp_path, monkeypatch):
    from sglang_ddtree.ab import cli as ab

    same = {name: [[1, 2, 3], [4, 5, 6]] for name in ("ddtree", "chain", "plain")}
    monkeypatch.setattr(ab, "run_arm", _fake_run_arm(same))
    assert (
        ab.main([*FAKE, "--out-dir", str(tmp_path), "--raw-dir", str(tmp_path / "raw"), "--label", "fake"])
        == 0
    )
    report, path = _one_report(tmp_path)
    assert path.name.startswith("ab_fake_")
    rows = {(r["arm"], r["concurrency"]): r for r in report["summary"]}
    assert rows[("ddtree", 4)]["output_tok_s"] == pytest.approx(200.5)  # median of 200, 201
    assert rows[("ddtree", 4)]["vs_baseline"] == pytest.approx(200.5 / 100.5)
    assert [w["winner"] for w in report["winners"]] == ["ddtree", "ddtree"]
    assert report["winners"][0]["clear"] is True  # 200 > 151: slowest beats the runner-up's fastest
    assert report["greedy_check"]["ok"] and report["parity"]["ok"]
    assert "| ddtree | 4 | 8 | 200.5 | 200.0-201.0 | 2.00x |" in path.with_suffix(".md").read_text()


def test_greedy_mismatch_fails_loudly(tmp_path, monkeypatch, capsys):
    from sglang_ddtree.ab import cli as ab

    outputs = {
        "ddtree": [[1, 2, 3], [4, 5, 7]],
        "chain": [[1, 2, 3], [4, 5, 6]],
        "plain": [[1, 2, 3], [4, 5, 6]],
    }
    monkeypatch.setattr(ab, "run_arm", _fake_run_arm(outputs))
    assert ab.main([*FAKE, "--out-dir", str(tmp_path), "--raw-dir", str(tmp_path / "raw")]) == 1
    assert "GREEDY CHECK FAILED" in capsys.readouterr().err
    report, path = _one_report(tmp_path)
    (mismatch,) = report["greedy_check"]["mismatches"]
    assert (mismatch["arm"], mismatch["prompt_index"], mismatch["first_diff_token"]) == ("ddtree", 1, 2)
    assert "**GREEDY CHECK FAILED" in path.with_suffix(".md").read_text()


def test_parity_difference_is_explained(tmp_path, monkeypatch):
    from sglang_ddtree.ab import cli as ab

    same = {name: [[1]] for name in ("ddtree", "chain", "plain")}
    readback = {"ddtree": {"disable_overlap_schedule": True}}
    monkeypatch.setattr(ab, "run_arm", _fake_run_arm(same, readback))
    argv = [
        *FAKE,
        "--out-dir",
        str(tmp_path),
        "--raw-dir",
        str(tmp_path / "raw"),
        "--arm-args",
        "chain=--disable-overlap-schedule",
    ]
    assert ab.main([*argv, "--strict-parity"]) == 3
    report, path = _one_report(tmp_path)
    (diff,) = report["parity"]["differences"]
    assert diff["key"] == "disable_overlap_schedule"
    assert diff["why"]["ddtree"].startswith("resolved by SGLang")
    assert diff["why"]["chain"] == "set by --disable-overlap-schedule"
    assert "NOT AT PARITY" in path.with_suffix(".md").read_text()


def test_bad_options_are_refused(tmp_path, capsys):
    from sglang_ddtree.ab import cli as ab

    assert ab.main(["--model", "m", "--arms", "ddtree,tree", "--out-dir", str(tmp_path)]) == 2
    assert "unknown arm 'tree'" in capsys.readouterr().err
    assert ab.main(["--model", "m", "--arms", "ddtree", "--out-dir", str(tmp_path)]) == 2
    assert "needs a drafter" in capsys.readouterr().err
    assert ab.main([*FAKE[:4], "--concurrency", "1,4", "--num-prompts", "1,2,3"]) == 2
    assert "one per level" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_online_budget_arms_serve_auto_beside_fixed_budgets():
    """``ddtree@auto`` / ``ddtree@autoB``: the online budget with trees of up to ``--budget`` /
    ``B`` nodes (``--speculative-num-draft-tokens`` B + 1), in the same run as fixed budgets."""
    from argparse import Namespace

    from sglang_ddtree.ab.arms import ABError, build_arms, parse_arm_names
    from sglang_ddtree.adapter.server_args import parse_budget

    assert parse_arm_names("ddtree@8,ddtree@auto,ddtree@auto16,plain") == [
        ("ddtree@8", "ddtree", 8),
        ("ddtree@auto", "ddtree", "auto"),
        ("ddtree@auto16", "ddtree", "auto16"),
        ("plain", "plain", None),
    ]
    opts = Namespace(arms="ddtree@8,ddtree@auto,ddtree@auto16", arm_args=[], chain_impl="dflash", budget=32)
    arms = {arm.name: arm.server_args for arm in build_arms(opts, "target", "drafter", [], cpu=False)}

    def flag(args, name):
        return args[args.index(name) + 1]

    assert flag(arms["ddtree@8"], "--speculative-ddtree-budget") == "8"
    assert "--speculative-num-draft-tokens" not in arms["ddtree@8"]
    for name, largest in (("ddtree@auto", 32), ("ddtree@auto16", 16)):
        assert parse_budget(flag(arms[name], "--speculative-ddtree-budget")) == "auto"
        assert flag(arms[name], "--speculative-num-draft-tokens") == str(largest + 1)
    for bad in ("ddtree@autox", "chain@auto", "ddtree@auto-8"):
        with pytest.raises(ABError, match="--arms"):
            parse_arm_names(bad)
