"""The A/B tool (``python -m sglang_ddtree.ab``).

End to end on the tiny models (``python -m lab.ab_tiny``): the interleaved schedule (two arms
and an A/A arm, all up at once, passes rotated) and the alternating one (servers started one at
a time, A B A B), each writing its file set and the results index and leaving no server or load
generator behind (checked by PID); a server that fails to start, and an interrupted or SIGKILLed
run, end with every process stopped. Without servers: the verdict logic on synthetic pairs, the
report, the arms, the schedule choice and the load worker's local dataset."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
from background import BACKGROUND
from processes import LOAD_GENERATOR_MARKS, RUN_TAG_ENV, kill_all, tagged_processes, wait_none_left

from sglang_ddtree.launch import live_group_members

AB = [sys.executable, "-m", "lab.ab_tiny"]
SMALL = ["--concurrency", "1", "--num-prompts", "4", "--input-len", "32", "--output-len", "16"]
SMALL += ["--repeats", "2", "--check-prompts", "2", "--check-tokens", "16", "--start-timeout", "900"]


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
    """Every server the report names (each start) and the load generator: gone, by PID."""
    for arm in report["arms"]:
        for server in arm["servers"]:
            port = str(server["port"])
            assert not _procs_with("sglang.launch_server", f"--port {port}"), (
                f"{arm['name']} server still runs"
            )
            if server["pid"] is not None:
                assert live_group_members(server["pid"]) == [], (
                    f"{arm['name']}'s process group still has members"
                )
                assert server["stopped"] is True, (arm["name"], server)
    worker = report["load_generator"]
    if worker.get("pid") is not None:
        assert live_group_members(worker["pid"]) == [], "the load generator still runs"
        assert worker["stopped"] is True
    assert report["servers_left_running"] == []


def _series(folder: Path, name: str) -> dict:
    path = folder / f"{name}.json"
    assert path.is_file(), f"no {path}; found {sorted(p.name for p in folder.iterdir())}"
    return json.loads(path.read_text())


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


def _results(folder: Path) -> list[str]:
    return ["--results-dir", str(folder / "results"), "--raw-dir", str(folder / "raw")]


# The tool's runs are background jobs (tests/background.py): each is the tool's and its
# servers' start-ups, mostly on one core, while other tests run; the tests read them.
def _run_to_end(job, args: list[str]) -> tuple[int, float]:
    started = time.monotonic()
    proc = job.track(_popen_tool(job.folder, [*args, *_results(job.folder)]))
    returncode = proc.wait(timeout=1500)
    return returncode, time.monotonic() - started


def _interleaved_run(job):
    return _run_to_end(job, ["--arms", "plain,ddtree,plain+again", *SMALL])


def _alternating_run(job):
    """Alternating with ``--prelaunch``: every server but the first is launched while the one
    before it measures, held at SGLang's gate until that one has stopped."""
    args = [
        "--arms",
        "ddtree,plain",
        "--schedule",
        "alternating",
        "--starts",
        "2",
        "--prelaunch",
        "--what",
        "alt",
    ]
    return _run_to_end(job, [*args, *SMALL])


def _failing_run(job):
    """A run whose ddtree arm's server cannot start (an unknown flag)."""
    return _run_to_end(
        job, ["--arms", "ddtree,plain", "--arm-args", "ddtree=--no-such-flag-for-the-ab-test", *SMALL]
    )


BACKGROUND.declare("ab-interleaved", "test_ab.py::test_ab_interleaved_end_to_end", _interleaved_run)
BACKGROUND.declare("ab-alternating", "test_ab.py::test_ab_alternating_end_to_end", _alternating_run)
BACKGROUND.declare("ab-start-failure", "test_ab.py::test_ab_server_start_failure_is_reported", _failing_run)


@pytest.mark.server
def test_ab_interleaved_end_to_end():
    job = BACKGROUND.job("ab-interleaved")
    returncode, elapsed = BACKGROUND.result("ab-interleaved")
    stdout, stderr = _outputs(job.folder)
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    results = job.folder / "results"
    report = _series(results, "tiny_cpu_ab")
    assert results.joinpath("tiny_cpu_ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["status"] == "ok" and report["error"] is None
    settings = report["settings"]
    assert settings["schedule"] == "interleaved" and "CPU" in settings["schedule_reason"]
    assert "--sleep-on-idle" in settings["schedule_added_args"] or all(
        "--sleep-on-idle" in a["server_args"] for a in report["arms"]
    )

    rows = {r["arm"]: r for r in report["summary"]}
    assert set(rows) == {"plain", "ddtree", "plain+again"}
    for name, row in rows.items():
        assert row["concurrency"] == 1 and row["passes"] == 2 and row["completed"] == 8, row
        for key in ("output_tok_s", "median_tpot_ms", "median_itl_ms", "median_ttft_ms", "vs_baseline"):
            assert isinstance(row[key], float) and row[key] > 0, (name, key, row[key])
        assert row["output_tok_s_interval"][0] <= row["output_tok_s"] <= row["output_tok_s_interval"][1]
    assert rows["plain"]["accept_length"] is None
    assert rows["ddtree"]["accept_length"] >= 1.0  # the bonus token at least, every round
    # the passes were interleaved, rotated per repeat: repeat 0 runs plain first, repeat 1 ddtree
    arms = {a["name"]: a for a in report["arms"]}
    firsts = {
        rep: min(
            (r["at_seconds"], name) for name, a in arms.items() for r in a["runs"] if r["repeat"] == rep
        )[1]
        for rep in (0, 1)
    }
    assert firsts == {0: "plain", 1: "ddtree"}, firsts
    # all three servers were up together: each one's passes lie between the others'
    spans = {name: [r["at_seconds"] for r in a["runs"]] for name, a in arms.items()}
    assert max(spans["plain"]) > min(spans["ddtree"]) and max(spans["ddtree"]) > min(spans["plain"])

    (aa,) = report["aa"]
    assert (aa["arm"], aa["of"], aa["pairs"]) == ("plain+again", "plain", 2)
    (cmp_,) = report["comparisons"]
    assert (cmp_["arm"], cmp_["reference"], cmp_["pairs"]) == ("ddtree", "plain", 2)
    assert cmp_["verdict"] == "unresolved" and "at least 3" in cmp_["why"]  # two repeats: no verdict
    assert report["greedy_check"]["ok"] and report["greedy_check"]["servers_checked"] == 3
    plain = arms["plain"]["servers"][0]  # plain kept its two best log-probs per token: each token its argmax
    assert [[row[0][1] for row in rows] for rows in plain["greedy_top2"]] == plain["greedy"]
    assert arms["ddtree"]["servers"][0]["greedy_top2"] is None
    assert report["parity"]["arms_read"] == ["plain", "ddtree", "plain+again"]
    stamp = report["stamp"]
    assert stamp["commit"] and stamp["date_utc"] and stamp["device_name"] == "cpu"
    assert stamp["command"].startswith("python -m lab.ab_tiny --arms plain,ddtree,plain+again")
    assert "--speculative-ddtree-budget 16" in arms["ddtree"]["launch_command"]

    md = results.joinpath("tiny_cpu_ab.md").read_text()
    assert f"| ddtree | 1 | 4 | 2 | {rows['ddtree']['output_tok_s']:.1f} [" in md
    assert "| plain+again | plain | 1 |" in md and "identical token ids" in md
    index = results.joinpath("README.md").read_text()
    assert "[tiny_cpu_ab](tiny_cpu_ab.md) | cpu | interleaved | ok | c=1: " in index
    assert index.startswith("# Results")
    _assert_nothing_left(report)
    print(f"A/B interleaved run: {elapsed:.0f} s")


@pytest.mark.server
def test_ab_alternating_end_to_end():
    job = BACKGROUND.job("ab-alternating")
    returncode, elapsed = BACKGROUND.result("ab-alternating")
    stdout, stderr = _outputs(job.folder)
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    report = _series(job.folder / "results", "tiny_cpu_alt")
    assert report["settings"]["schedule"] == "alternating" and report["settings"]["starts"] == 2
    arms = {a["name"]: a for a in report["arms"]}
    # four servers, one at a time, in the order ddtree plain ddtree plain; every start measured
    timeline = sorted((r["at_seconds"], name, r["start"]) for name, a in arms.items() for r in a["runs"])
    starts_in_order = [(name, start) for _, name, start in timeline]
    blocks = [starts_in_order[i] for i in range(0, len(starts_in_order), 2)]
    assert blocks == [("ddtree", 0), ("plain", 0), ("ddtree", 1), ("plain", 1)], starts_in_order
    for a in arms.values():
        assert [s["start"] for s in a["servers"]] == [0, 1]
        assert len({s["pid"] for s in a["servers"]}) == 2
    # --prelaunch: each later server was launched while the one before it measured, waited at
    # SGLang's gate (its log says so) and was let in only once that one had stopped
    servers = sorted((s for a in report["arms"] for s in a["servers"]), key=lambda s: s["log"])
    held = [s for s in servers if "held_seconds" in s]
    assert len(held) == 3 and all(s["held_seconds"] > 0 for s in held), servers
    for s in held:
        log = Path(s["log"]).read_text()
        assert "Gated launch waiting for activation" in log and "Gated launch activated" in log, log[-2000:]
    cells = {r["arm"]: r for r in report["summary"]}
    assert cells["ddtree"]["passes"] == 4 and len(cells["ddtree"]["start_tok_s"]) == 2
    assert cells["ddtree"]["start_spread"] >= 1.0
    (cmp_,) = report["comparisons"]
    assert (cmp_["arm"], cmp_["reference"], cmp_["pairs"]) == ("ddtree", "plain", 4)
    # no A/A arm here: never a verdict (the reason depends on the measured interval: one that
    # includes 1 is reported as such first; tests/test_paired.py covers each reason)
    assert cmp_["verdict"] == "unresolved"
    assert "no A/A arm" in cmp_["why"] or cmp_["why"] == "the interval includes 1", cmp_["why"]
    assert set(cmp_["start_spread"]) == {"ddtree", "plain"}
    md = (job.folder / "results" / "tiny_cpu_alt.md").read_text()
    assert "start spread" in md and "Schedule **alternating**" in md
    assert md.count(" s before)") == 3  # the held servers' start times count from their gates
    assert report["greedy_check"]["ok"] and report["greedy_check"]["servers_checked"] == 4
    index = (job.folder / "results" / "README.md").read_text()
    assert "[tiny_cpu_alt](tiny_cpu_alt.md)" in index
    _assert_nothing_left(report)
    print(f"A/B alternating run: {elapsed:.0f} s")


@pytest.mark.server
def test_ab_server_start_failure_is_reported():
    job = BACKGROUND.job("ab-start-failure")
    returncode, _ = BACKGROUND.result("ab-start-failure")
    stdout, stderr = _outputs(job.folder)
    assert returncode == 2, stdout[-3000:] + stderr[-3000:]
    assert "the 'ddtree' arm's server did not start" in stderr
    assert "--- last lines of" in stderr  # the server log's tail
    assert "--no-such-flag-for-the-ab-test" in stderr.split("--- last lines of", 1)[1]
    report = _series(job.folder / "results", "tiny_cpu_ab")
    assert report["status"] == "failed" and "did not start" in report["error"]
    arms = {a["name"]: a for a in report["arms"]}
    assert arms["ddtree"]["error"] and arms["ddtree"]["servers"][0]["error"]
    assert not any(a["runs"] for a in report["arms"]), "passes ran after an arm failed"
    _assert_nothing_left(report)  # the plain server, launched beside it, stopped too


def _loaded_run_tag(folder: Path) -> str:
    return f"ab-{folder.name}-{os.getpid()}"


def _launch_loaded_run(job) -> subprocess.Popen:
    """The A/B tool with a long load to run; its processes carry their own tag, which the
    test checks."""
    many = ["--concurrency", "1", "--num-prompts", "200", "--output-len", "64", "--check-prompts", "1"]
    args = ["--arms", "plain,ddtree", *many, "--start-timeout", "900", *_results(job.folder)]
    env = {**os.environ, RUN_TAG_ENV: _loaded_run_tag(job.folder)}
    return job.track(_popen_tool(job.folder, args, env=env))


def _wait_for_load(proc: subprocess.Popen, folder: Path) -> None:
    """Until the tool's servers are up and a load pass runs."""
    deadline = time.monotonic() + 1200
    while not list((folder / "raw").glob("bench_*_c*_r*.log")):  # a pass's log
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
    report = _series(job.folder / "results", "tiny_cpu_ab")
    assert report["status"] == "interrupted"
    assert all(a["servers"] and a["servers"][0]["pid"] for a in report["arms"])  # both were up
    _assert_nothing_left(report)


@pytest.mark.server
def test_ab_sigkill_leaves_nothing_behind():
    """No clean-up code runs in a SIGKILLed tool: its servers (schedulers included) and load
    generator must still go, by parent-death signal and watchdog."""
    job = BACKGROUND.job("ab-sigkill")
    started = BACKGROUND.result("ab-sigkill")
    assert any("sglang::scheduler" in cmd or "launch_server" in cmd for cmd in started.values()), started
    assert any(any(m in cmd for m in LOAD_GENERATOR_MARKS) for cmd in started.values()), started
    _assert_no_process_left(_loaded_run_tag(job.folder))


# --------------------------------------------------------------------------- the verdict, on synthetic pairs


def test_verdict_inside_the_aa_spread_is_unresolved():
    from sglang_ddtree.ab import paired

    # the A/A of this run: two servers of one arm 1.05x [0.98, 1.14] apart (the H200's c=1)
    band = paired.aa_band([[0.98, 1.14]])
    assert band[0] == pytest.approx(1 / 1.14) and band[1] == pytest.approx(1.14)
    # a 1.10x gain whose interval excludes 1 but lies inside the A/A spread: not a win
    ratios = [1.08, 1.10, 1.12, 1.09, 1.11]
    result = paired.compare(ratios)
    assert result["interval"][0] > 1.0
    assert paired.verdict(result["interval"], result["pairs"], band) == (
        paired.UNRESOLVED,
        "the interval lies above 1 but overlaps the A/A spread",
    )
    # the same below 1
    slow = paired.compare([1 / r for r in ratios])
    assert paired.verdict(slow["interval"], slow["pairs"], band)[0] == paired.UNRESOLVED


def test_verdict_outside_the_aa_spread_wins_or_loses():
    from sglang_ddtree.ab import paired

    band = paired.aa_band([[0.98, 1.14], [0.95, 1.05]])  # the widest of two A/A arms
    fast = paired.compare([1.31, 1.33, 1.36, 1.29, 1.34])  # DDTREE@32 over DFLASH at c=1 (issue 46)
    assert paired.verdict(fast["interval"], fast["pairs"], band)[0] == paired.WINS
    slow = paired.compare([0.61, 0.64, 0.60, 0.66, 0.63])
    assert paired.verdict(slow["interval"], slow["pairs"], band)[0] == paired.LOSES
    # without an A/A arm, or with too few pairs, or an interval over 1: no verdict
    assert paired.verdict(fast["interval"], fast["pairs"], None)[0] == paired.UNRESOLVED
    two = paired.compare([1.31, 1.33])
    assert paired.verdict(two["interval"], two["pairs"], band)[0] == paired.UNRESOLVED
    wide = paired.compare([0.9, 1.4, 1.3, 0.95, 1.2])
    assert paired.verdict(wide["interval"], wide["pairs"], band) == (
        paired.UNRESOLVED,
        "the interval includes 1",
    )


def test_pairs_from_several_starts_are_resampled_by_start():
    """Alternating: passes of one start share its luck; the interval resamples whole starts."""
    from sglang_ddtree.ab import paired

    # three starts, ten passes each: each start's passes agree, the starts do not
    ratios = [1.0] * 10 + [1.2] * 10 + [1.4] * 10
    starts = [0] * 10 + [1] * 10 + [2] * 10
    pooled = paired.median_interval(ratios)
    by_start = paired.median_interval(ratios, groups=starts)
    assert pooled[1] - pooled[0] < 0.1  # thirty "independent" pairs: falsely sure
    assert by_start[0] == pytest.approx(1.0) and by_start[1] == pytest.approx(1.4)


# --------------------------------------------------------------------------- no server: the engine and the report


class _FakeServer:
    url = "http://127.0.0.1:1"

    def log_tail(self, lines=20):
        return "(fake server)"


class _FakeWorker:
    pid, log_path = None, "(fake load generator)"

    def __init__(self, *args, **kwargs):
        pass

    def wait_ready(self, timeout):
        pass

    def stop(self):
        return True


def _fake_engine(
    monkeypatch, greedy_by_arm: dict, readback_by_arm: dict | None = None, speeds=None, top2=None
):
    """The engine with every server and pass faked: speed per arm times a spell per repeat
    (shared by every arm of the repeat), as an interleaved run on a host with slow spells."""
    from sglang_ddtree.ab import engine, run

    speeds = speeds or {"plain": 100.0, "dflash": 150.0, "dflash+again": 150.0}
    spells = [1.0, 0.6, 1.4, 0.8, 1.2]
    by_server, logs = {}, {}

    def new_server(arm, opts, start, gated=False):
        server, record = run.new_server(arm, opts, start, gated)
        fake = _FakeServer()
        fake.log_path = Path(record["log"])
        fake.log_path.write_text("server log\n")
        by_server[id(fake)] = arm
        logs[arm.name] = fake.log_path  # its latest start's
        return fake, record

    def check_server(server, record, opts, reference=False):
        arm = by_server[id(server)]
        record["readback"] = {"disable_overlap_schedule": False, "cuda_graph_config.decode.max_bs": 64}
        record["readback"].update((readback_by_arm or {}).get(arm.name, {}))
        record["greedy"] = greedy_by_arm[arm.base]
        record["greedy_top2"] = top2 if reference and opts.greedy_margin > 0 else None

    def run_pass(worker, url, opts, *, concurrency, num_prompts, stem):
        rep = int(stem.split("_r")[-1].split("_")[0])
        arm = next(a for a in by_server.values() if stem.startswith(run.safe_name(a.name) + "_c"))
        name = arm.name
        speed = speeds.get(name, 200.0) * spells[rep % len(spells)]
        if "SGLANG_DDTREE_PHASE_TIMES" in arm.env:  # the phase timer's lines of this pass
            with open(logs[name], "a") as f:
                for build in (40.0, 60.0 + rep):
                    f.write(f"[x] WARNING DDTREE phase host us/round: {{'build': {build}, 'round': 900.0}}\n")
        return {
            "completed": num_prompts,
            "output_throughput": speed,
            "median_tpot_ms": 1000.0 / speed,
            "median_itl_ms": 1000.0 / speed,
            "median_ttft_ms": 10.0,
            "p99_ttft_ms": 20.0,
            "accept_length": None if name.startswith("plain") else 3.0,
        }

    monkeypatch.setattr(engine, "new_server", new_server)
    monkeypatch.setattr(engine, "launch", lambda server, record: None)
    monkeypatch.setattr(engine, "open_gate", lambda server, record, timeout: record.update(held_seconds=1.0))
    monkeypatch.setattr(engine, "wait_up", lambda server, record: record.update(start_seconds=0.0))
    monkeypatch.setattr(engine, "check_server", check_server)
    monkeypatch.setattr(engine, "run_pass", run_pass)
    monkeypatch.setattr(engine, "stop", lambda server, record: record.update(stopped=True))
    monkeypatch.setattr(engine, "LoadWorker", _FakeWorker)


FAKE = ["--model", "/nonexistent/target", "--drafter", "/nonexistent/drafter", "--device-name", "h200"]
FAKE += ["--concurrency", "1,4", "--num-prompts", "8", "--repeats", "5", "--check-prompts", "2", "--no-plot"]
FAKE += ["--server-args", "--mem-fraction-static 0.1", "--label", "fake"]


def _argv(tmp_path, *extra):
    return [*FAKE, "--results-dir", str(tmp_path), "--raw-dir", str(tmp_path / "raw"), *extra]


def test_report_verdicts_aa_and_ratios(tmp_path, monkeypatch):
    from sglang_ddtree.ab import cli as ab

    same = {name: [[1, 2, 3], [4, 5, 6]] for name in ("plain", "dflash", "ddtree")}
    _fake_engine(monkeypatch, same)
    assert ab.main(_argv(tmp_path, "--arms", "plain,dflash,ddtree,dflash+again")) == 0
    report = _series(tmp_path, "fake_h200_ab")
    assert report["settings"]["schedule"] == "interleaved"
    assert "0.40 of each GPU's memory" in report["settings"]["schedule_reason"]  # 4 servers x 0.1
    rows = {(r["arm"], r["concurrency"]): r for r in report["summary"]}
    assert rows[("ddtree", 4)]["output_tok_s"] == pytest.approx(200.0)  # median of 200 x spells
    assert rows[("ddtree", 4)]["output_tok_s_min"] == pytest.approx(120.0)
    comps = {(c["arm"], c["reference"], c["concurrency"]): c for c in report["comparisons"]}
    # the spells hit every arm of a repeat alike: the paired ratio is exact, and outside the A/A
    exact = comps[("ddtree", "plain", 1)]
    assert exact["ratio"] == pytest.approx(2.0) and exact["interval"] == pytest.approx([2.0, 2.0])
    assert exact["aa_band"] == pytest.approx([1.0, 1.0]) and exact["verdict"] == "wins"
    assert comps[("ddtree", "dflash", 4)]["ratio"] == pytest.approx(200 / 150)  # against the chain
    assert ("dflash+again", "plain", 1) not in comps  # the A/A arm is the spread, not a contender
    assert [h["arm"] for h in report["headline"]] == ["ddtree", "ddtree"]
    # each repeat ran one pass of every arm, the order rotated by one arm per repeat
    names = report["settings"]["arms"]
    for arm in report["arms"]:
        for run in arm["runs"]:
            assert names[(run["repeat"] + run["order"]) % len(names)] == arm["name"], (arm["name"], run)
    assert [(a["arm"], a["of"]) for a in report["aa"]] == [("dflash+again", "dflash")] * 2
    assert report["greedy_check"]["ok"] and report["parity"]["ok"]
    md = (tmp_path / "fake_h200_ab.md").read_text()
    assert "| ddtree | plain | 1 | 2.00x [2.00, 2.00] | 5 | [1.00, 1.00] | **wins** |" in md
    # the same pairs by decode pace (the fake passes' TPOT follows their tok/s)
    pace = md.split("### Decode pace (1 / TPOT)", 1)[1]
    assert "| ddtree | plain | 1 | 2.00x [2.00, 2.00] | 5 | [1.00, 1.00] | **wins** |" in pace
    index = (tmp_path / "README.md").read_text()
    assert "c=1: ddtree 2.00x [2.00, 2.00] vs plain, A/A [1.00, 1.00], **wins**" in index


def test_the_online_budget_is_compared_with_every_fixed_choice_and_the_fastest_named(tmp_path, monkeypatch):
    """Issue 48's reading: ``auto`` against the fastest of plain, the chain and each fixed
    budget, per level, paired (here DDTREE@16 is fastest and ``auto`` makes 0.95x of it)."""
    from sglang_ddtree.ab import cli as ab

    names = ("plain", "chain", "ddtree@16", "ddtree@auto16")
    speeds = {
        "plain": 100.0,
        "chain": 150.0,
        "chain+again": 150.0,
        "ddtree@16": 200.0,
        "ddtree@auto16": 190.0,
    }
    _fake_engine(monkeypatch, {n: [[1, 2]] for n in names}, speeds=speeds)
    assert ab.main(_argv(tmp_path, "--arms", ",".join(names) + ",chain+again", "--block-size", "8")) == 0
    report = _series(tmp_path, "fake_h200_ab")
    pairs = [(c["arm"], c["reference"], c["against"]) for c in report["comparisons"] if c["concurrency"] == 1]
    assert ("ddtree@auto16", "ddtree@16", "fixed") in pairs
    assert [p for p in pairs if p[:2] == ("ddtree@auto16", "chain")] == [("ddtree@auto16", "chain", "chain")]
    assert not [
        p for p in pairs if p[1] == "ddtree@auto16" or p[0] in ("ddtree@16", "chain") and p[2] == "fixed"
    ]
    best = report["online_budget"]
    assert [(r["arm"], r["concurrency"], r["reference"]) for r in best] == [
        ("ddtree@auto16", 1, "ddtree@16"),
        ("ddtree@auto16", 4, "ddtree@16"),
    ]
    assert best[0]["ratio"] == pytest.approx(0.95) and best[0]["verdict"] == "loses"
    md = (tmp_path / "fake_h200_ab.md").read_text()
    assert "| ddtree@auto16 | 1 | ddtree@16 | 0.95x [0.95, 0.95] | [1.00, 1.00] | **loses** |" in md


def test_an_arm_is_compared_with_its_variants(tmp_path, monkeypatch):
    """``ddtree@32`` over ``ddtree@32+heapq`` (the same tree, built by Python's heapq on the
    host): what the GPU tree step buys over the live service's builder, paired per pass. The
    A/A server and the phase timer's variant are not contenders."""
    from sglang_ddtree.ab import cli as ab

    names = ("plain", "ddtree@32", "ddtree@32+heapq", "ddtree@32+phases", "plain+again")
    speeds = {"plain": 100.0, "plain+again": 100.0, "ddtree@32": 180.0, "ddtree@32+heapq": 120.0}
    _fake_engine(monkeypatch, {n: [[1, 2]] for n in ("plain", "ddtree@32")}, speeds=speeds)
    assert ab.main(_argv(tmp_path, "--arms", ",".join(names), "--block-size", "8")) == 0
    report = _series(tmp_path, "fake_h200_ab")
    rows = {(c["arm"], c["reference"]): c for c in report["comparisons"] if c["concurrency"] == 1}
    assert rows[("ddtree@32", "ddtree@32+heapq")]["against"] == "variant"
    assert rows[("ddtree@32", "ddtree@32+heapq")]["ratio"] == pytest.approx(1.5)
    assert rows[("ddtree@32", "ddtree@32+heapq")]["verdict"] == "wins"
    assert not [pair for pair in rows if "+phases" in pair[1] or "+again" in pair[1]]
    assert ("ddtree@32+heapq", "plain") in rows and ("plain", "plain+again") not in rows
    md = (tmp_path / "fake_h200_ab.md").read_text()
    assert "| ddtree@32 | ddtree@32+heapq | 1 | 1.50x [1.50, 1.50] |" in md


def test_a_rerun_replaces_the_series_and_the_index_lists_each_once(tmp_path, monkeypatch):
    from sglang_ddtree.ab import cli as ab
    from sglang_ddtree.ab import index

    same = {name: [[1]] for name in ("plain", "dflash", "ddtree")}
    _fake_engine(monkeypatch, same)
    assert ab.main(_argv(tmp_path, "--arms", "plain,ddtree")) == 0
    first = _series(tmp_path, "fake_h200_ab")
    _fake_engine(monkeypatch, same, speeds={"plain": 100.0, "ddtree": 50.0})
    assert ab.main(_argv(tmp_path, "--arms", "plain,ddtree", "--what", "ab")) == 0
    assert ab.main(_argv(tmp_path, "--arms", "plain,ddtree", "--what", "other")) == 0
    again = _series(tmp_path, "fake_h200_ab")
    assert again["summary"] != first["summary"]
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["fake_h200_ab.json", "fake_h200_other.json"]
    readme = (tmp_path / "README.md").read_text()
    assert readme.count("[fake_h200_ab]") == 1 and readme.count("[fake_h200_other]") == 1
    (tmp_path / "unrelated.json").write_text("[1, 2]")  # other JSON in the folder is left alone
    index.main([str(tmp_path)])
    assert "unrelated" not in (tmp_path / "README.md").read_text()
    # a README written by hand keeps its text; only the A/B section between the markers changes
    hand = "# Results\n\nSeries measured by other tools.\n\n## How each series is made\n\n- by hand\n"
    (tmp_path / "README.md").write_text(hand)
    index.main([str(tmp_path)])
    once = (tmp_path / "README.md").read_text()
    assert once.startswith(hand.rstrip("\n")) and once.count(index.START) == 1
    (tmp_path / "README.md").write_text(once.replace(index.END, index.END + "\n\nMore by hand.\n"))
    index.main([str(tmp_path)])
    twice = (tmp_path / "README.md").read_text()
    assert twice.count(index.START) == 1 and twice.count("[fake_h200_ab]") == 1
    assert twice.startswith(hand.rstrip("\n")) and twice.rstrip().endswith("More by hand.")


def test_alternating_pairs_starts_by_index(tmp_path, monkeypatch):
    from sglang_ddtree.ab import cli as ab

    same = {name: [[1]] for name in ("plain", "dflash", "ddtree")}
    _fake_engine(monkeypatch, same)
    argv = _argv(
        tmp_path, "--arms", "plain,ddtree,ddtree+again", "--schedule", "alternating", "--starts", "3"
    )
    assert ab.main([*argv, "--repeats", "2"]) == 0
    report = _series(tmp_path, "fake_h200_ab")
    assert report["settings"]["schedule"] == "alternating"
    arms = {a["name"]: a for a in report["arms"]}
    assert [s["start"] for s in arms["ddtree"]["servers"]] == [0, 1, 2]
    comps = {(c["arm"], c["concurrency"]): c for c in report["comparisons"]}
    assert comps[("ddtree", 1)]["pairs"] == 6  # 3 starts x 2 repeats
    assert comps[("ddtree", 1)]["start_spread"] == {"ddtree": pytest.approx(1.0), "plain": pytest.approx(1.0)}
    assert "start spread" in (tmp_path / "fake_h200_ab.md").read_text()


def test_keep_going_drops_an_arm_that_did_not_start(tmp_path, monkeypatch, capsys):
    from sglang_ddtree.ab import cli as ab
    from sglang_ddtree.ab import engine
    from sglang_ddtree.launch import ServerStartError

    same = {name: [[1]] for name in ("plain", "dflash", "ddtree")}
    _fake_engine(monkeypatch, same)

    def wait_up(server, record):
        if "ddtree" in record["log"]:
            raise ServerStartError("ddtree server was not ready after 300 s.\n--- last lines of its log ---")
        record["start_seconds"] = 0.0

    monkeypatch.setattr(engine, "wait_up", wait_up)
    argv = _argv(tmp_path, "--arms", "plain,dflash,ddtree,dflash+again")
    assert ab.main(argv) == 2  # by default the run fails
    assert "the 'ddtree' arm's server did not start" in capsys.readouterr().err
    assert ab.main([*argv, "--keep-going"]) == 0
    report = _series(tmp_path, "fake_h200_ab")
    assert list(report["dropped"]) == ["ddtree"] and "not ready after 300 s" in report["dropped"]["ddtree"]
    assert {r["arm"] for r in report["summary"]} == {"plain", "dflash", "dflash+again"}
    assert {(c["arm"], c["verdict"]) for c in report["comparisons"]} == {("dflash", "wins")}
    assert "**ddtree dropped (--keep-going)**" in (tmp_path / "fake_h200_ab.md").read_text()


def test_runs_of_one_series_merge_start_after_start(tmp_path, monkeypatch, capsys):
    """A series too long for one call: each call's servers become the next starts."""
    from sglang_ddtree.ab import cli as ab
    from sglang_ddtree.ab import merge

    same = {name: [[1]] for name in ("plain", "dflash", "ddtree")}
    _fake_engine(monkeypatch, same)
    base = [*FAKE, "--raw-dir", str(tmp_path / "raw"), "--arms", "plain,ddtree,ddtree+again"]
    base += ["--repeats", "2", "--schedule", "alternating", "--starts", "1"]
    assert ab.main([*base, "--results-dir", str(tmp_path / "a")]) == 0
    assert ab.main([*base, "--results-dir", str(tmp_path / "b")]) == 0
    runs = [str(tmp_path / d / "fake_h200_ab.json") for d in ("a", "b")]
    out = tmp_path / "merged"
    assert merge.main([*runs, "--series", "fake_h200_ab", "--results-dir", str(out)]) == 0
    report = _series(out, "fake_h200_ab")
    assert report["settings"]["schedule"] == "alternating" and report["settings"]["starts"] == 2
    arms = {a["name"]: a for a in report["arms"]}
    assert [s["start"] for s in arms["ddtree"]["servers"]] == [0, 1]
    assert [(r["start"], r["repeat"]) for r in arms["ddtree"]["runs"] if r["concurrency_requested"] == 1] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    cell = next(c for c in report["summary"] if (c["arm"], c["concurrency"]) == ("ddtree", 1))
    assert len(cell["start_tok_s"]) == 2 and cell["start_spread"] == pytest.approx(1.0)
    comps = {(c["arm"], c["concurrency"]): c for c in report["comparisons"]}
    assert comps[("ddtree", 1)]["pairs"] == 4 and comps[("ddtree", 1)]["verdict"] == "wins"
    assert [m["series"] for m in report["settings"]["merged_from"]] == ["fake_h200_ab", "fake_h200_ab"]
    assert report["stamp"]["device_name"] == "h200" and "sglang_ddtree.ab.merge" in report["stamp"]["command"]
    # a merged series rebuilt (a newer report of the same passes) still names the runs that made it
    again = tmp_path / "rebuilt"
    assert (
        merge.main([str(out / "fake_h200_ab.json"), "--series", "fake_h200_ab", "--results-dir", str(again)])
        == 0
    )
    rebuilt = _series(again, "fake_h200_ab")
    assert rebuilt["settings"]["merged_from"] == report["settings"]["merged_from"]
    assert rebuilt["comparisons"] == report["comparisons"] and rebuilt["settings"]["starts"] == 2
    # runs of other requests, or of other flags, do not merge
    other, interleaved = tmp_path / "c", tmp_path / "i"
    assert ab.main([*base, "--results-dir", str(other), "--output-len", "64"]) == 0
    x = ["--series", "x", "--results-dir", str(out)]
    assert merge.main([runs[0], str(other / "fake_h200_ab.json"), *x]) == 2
    assert "output_len 64 differs from 256" in capsys.readouterr().err
    assert ab.main([*base, "--schedule", "interleaved", "--results-dir", str(interleaved)]) == 0
    assert merge.main([runs[0], str(interleaved / "fake_h200_ab.json"), *x]) == 2  # --sleep-on-idle
    assert "plain: other flags or environment" in capsys.readouterr().err


def test_runs_made_in_two_folders_merge_with_their_paths_read_as_one(tmp_path, monkeypatch, capsys):
    """Two calls whose prompts and arm environment lie in each call's own work folder."""
    from sglang_ddtree.ab import cli as ab
    from sglang_ddtree.ab import merge

    _fake_engine(monkeypatch, {name: [[1]] for name in ("plain", "ddtree")})
    prompts = [[5, 6, 7], [8, 9]]
    runs = []
    for call in ("call1", "call2"):
        work = tmp_path / f"{call}_work"
        work.mkdir()
        (work / "prompts.json").write_text(json.dumps(prompts))
        argv = [*FAKE, "--raw-dir", str(tmp_path / "raw"), "--arms", "plain,ddtree", "--repeats", "2"]
        argv += ["--schedule", "alternating", "--starts", "1", "--results-dir", str(tmp_path / call)]
        argv += ["--dataset", "custom", "--dataset-path", str(work / "prompts.json")]
        argv += ["--arm-env", f"ddtree=RECORDING={work}/recording.json"]
        assert ab.main(argv) == 0
        runs.append(str(tmp_path / call / "fake_h200_ab.json"))
    x = ["--series", "m", "--results-dir", str(tmp_path / "m"), "--no-index"]
    assert merge.main([*runs, *x]) == 2
    err = capsys.readouterr().err
    assert "dataset_path" in err and "ddtree: other flags or environment" in err
    same = f"{tmp_path}/call2_work={tmp_path}/call1_work"
    assert merge.main([*runs, *x, "--same-path", same]) == 0
    report = _series(tmp_path / "m", "m")
    assert (
        report["settings"]["same_paths"] == [same]
        and "paths read as the same" in report["settings"]["schedule_reason"]
    )
    assert [s["start"] for s in next(a for a in report["arms"] if a["name"] == "ddtree")["servers"]] == [0, 1]
    # the greedy prompts are still compared: other prompts behind the same path do not merge
    other = json.loads(Path(runs[1]).read_text())
    other["settings"]["check_prompts"] = [[1, 2]]
    Path(runs[1]).write_text(json.dumps(other))
    assert merge.main([*runs, *x, "--same-path", same]) == 2
    assert "check_prompts" in capsys.readouterr().err


def test_greedy_mismatch_fails_loudly(tmp_path, monkeypatch, capsys):
    from sglang_ddtree.ab import cli as ab

    outputs = {
        "ddtree": [[1, 2, 3], [4, 5, 7]],
        "dflash": [[1, 2, 3], [4, 5, 6]],
        "plain": [[1, 2, 3], [4, 5, 6]],
    }
    _fake_engine(monkeypatch, outputs)
    assert ab.main(_argv(tmp_path, "--arms", "plain,dflash,ddtree")) == 1
    assert "GREEDY CHECK FAILED" in capsys.readouterr().err
    report = _series(tmp_path, "fake_h200_ab")
    (mismatch,) = report["greedy_check"]["mismatches"]
    assert (mismatch["arm"], mismatch["prompt_index"], mismatch["first_diff_token"]) == ("ddtree", 1, 2)
    assert "**GREEDY CHECK FAILED" in (tmp_path / "fake_h200_ab.md").read_text()
    assert "| interleaved | ok, **greedy check failed** |" in (tmp_path / "README.md").read_text()


def _top2_at_divergence(gap: float) -> list:
    """plain's two best per token of the outputs below: at prompt 1's third token, 6 leads 7 by
    ``gap`` nats (elsewhere by far)."""
    far = lambda best, second: [[-0.01, best], [-9.0, second]]  # noqa: E731
    return [[far(1, 0), far(2, 0), far(3, 0)], [far(4, 0), far(5, 0), [[-0.6, 6], [-0.6 - gap, 7]]]]


NEAR_TIE_OUTPUTS = {
    "ddtree": [[1, 2, 3], [4, 5, 7]],
    "dflash": [[1, 2, 3], [4, 5, 6]],
    "plain": [[1, 2, 3], [4, 5, 6]],
}


def test_greedy_divergence_at_a_near_tie_of_plain_is_rounding(tmp_path, monkeypatch, capsys):
    from sglang_ddtree.ab import cli as ab

    _fake_engine(monkeypatch, NEAR_TIE_OUTPUTS, top2=_top2_at_divergence(0.1))
    assert ab.main(_argv(tmp_path, "--arms", "plain,dflash,ddtree")) == 0
    gc = _series(tmp_path, "fake_h200_ab")["greedy_check"]
    assert gc["ok"] and gc["near_ties"] == 1 and gc["margin"] == 0.25
    (mismatch,) = gc["mismatches"]
    assert mismatch["near_tie"] and abs(mismatch["gap"] - 0.1) < 1e-9
    assert "up to 1 near-ties of plain's argmax" in gc["message"]
    md = (tmp_path / "fake_h200_ab.md").read_text()
    assert "GREEDY CHECK FAILED" not in md and "0.1 nats below plain's argmax: a near-tie" in md


def test_greedy_margin_is_judged_by_any_baseline_arm(tmp_path, monkeypatch, capsys):
    """Without a plain arm (e.g. the stock chain as the baseline) the baseline keeps its two best
    log-probs: a near-tie of its own forward is rounding, a token outside them still fails."""
    from sglang_ddtree.ab import cli as ab

    outputs = {"ddtree": NEAR_TIE_OUTPUTS["ddtree"], "dflash": NEAR_TIE_OUTPUTS["dflash"]}
    _fake_engine(monkeypatch, outputs, top2=_top2_at_divergence(0.1))
    assert ab.main(_argv(tmp_path, "--arms", "dflash,ddtree,dflash+again")) == 0
    gc = _series(tmp_path, "fake_h200_ab")["greedy_check"]
    assert gc["ok"] and gc["reference"] == "dflash" and gc["reference_logprobs"] and gc["near_ties"] == 1
    assert "0.1 nats below dflash's argmax: a near-tie" in (tmp_path / "fake_h200_ab.md").read_text()

    _fake_engine(monkeypatch, outputs, top2=_top2_at_divergence(0.5))
    assert ab.main(_argv(tmp_path, "--arms", "dflash,ddtree")) == 1
    assert (
        "ddtree prompt 1 diverges from dflash at token 2 (0.5 nats below its argmax)"
        in capsys.readouterr().err
    )


def test_greedy_divergence_without_the_references_log_probs_says_its_margin_is_unknown(tmp_path, monkeypatch):
    from sglang_ddtree.ab import cli as ab

    _fake_engine(monkeypatch, NEAR_TIE_OUTPUTS, top2=None)
    assert ab.main(_argv(tmp_path, "--arms", "plain,dflash,ddtree")) == 1
    gc = _series(tmp_path, "fake_h200_ab")["greedy_check"]
    assert not gc["ok"] and not gc["reference_logprobs"]
    md = (tmp_path / "fake_h200_ab.md").read_text()
    assert "(margin unknown: plain's log-probs were not recorded)" in md and "two best there" not in md


def test_greedy_divergence_at_an_exact_tie_listed_in_the_other_order_is_a_near_tie():
    """On the H200 plain's sampler chose 86 where its top-k listed 664 first at the same bf16
    log-prob; the arm chose 664: a gap of 0, not "not among plain's two best"."""
    from sglang_ddtree.ab.greedy_check import _divergence_gap

    tie = [[[[-2.85, 664], [-2.85, 86]]]]
    assert _divergence_gap(tie, 0, 0, [664]) == 0.0
    assert _divergence_gap(tie, 0, 0, [86]) == 0.0
    assert _divergence_gap([[[[-0.6, 6], [-0.9, 7]]]], 0, 0, [7]) == pytest.approx(0.3)
    assert _divergence_gap([[[[-0.6, 6], [-0.9, 7]]]], 0, 0, [8]) is None  # not among its two best


def test_greedy_divergence_beyond_the_margin_fails(tmp_path, monkeypatch, capsys):
    from sglang_ddtree.ab import cli as ab

    _fake_engine(monkeypatch, NEAR_TIE_OUTPUTS, top2=_top2_at_divergence(0.5))
    assert ab.main(_argv(tmp_path, "--arms", "plain,dflash,ddtree")) == 1
    assert (
        "ddtree prompt 1 diverges from plain at token 2 (0.5 nats below its argmax)"
        in capsys.readouterr().err
    )
    # the same near-tie is a failure where only identity is asked for
    _fake_engine(monkeypatch, NEAR_TIE_OUTPUTS, top2=_top2_at_divergence(0.1))
    assert ab.main(_argv(tmp_path, "--arms", "plain,dflash,ddtree", "--greedy-margin", "0")) == 1
    assert not _series(tmp_path, "fake_h200_ab")["greedy_check"]["ok"]


def test_alternating_time_limit_gates_starts_not_the_passes_of_a_started_server(tmp_path, monkeypatch):
    """A 61-layer server takes minutes to start: one started before the limit runs all its
    passes, and no server starts after it."""
    from sglang_ddtree.ab import cli as ab
    from sglang_ddtree.ab import engine

    _fake_engine(monkeypatch, {name: [[1]] for name in ("plain", "dflash")})
    launched = []
    monkeypatch.setattr(engine, "launch", lambda server, record: launched.append(record))
    monkeypatch.setattr(
        engine.Engine, "_past_deadline", lambda self: len(launched) >= 2
    )  # from dflash's start
    argv = _argv(
        tmp_path,
        "--arms",
        "plain,dflash,dflash+again",
        "--schedule",
        "alternating",
        "--starts",
        "1",
        "--time-limit",
        "1",
    )
    ab.main(argv)
    report = _series(tmp_path, "fake_h200_ab")
    runs = {a["name"]: len(a["runs"]) for a in report["arms"]}
    assert runs == {"plain": 10, "dflash": 10, "dflash+again": 0}  # 2 levels x 5 repeats each
    assert report["skipped"] == ["dflash+again start 1: not started, past --time-limit"]


def test_prelaunch_holds_the_next_server_and_stops_it_past_the_time_limit(tmp_path, monkeypatch):
    """--prelaunch: each next server is launched once the current one has passed its check, held
    (gated) until the current one stops, then let in; one whose turn comes past the limit is
    stopped without being let in."""
    from sglang_ddtree.ab import cli as ab
    from sglang_ddtree.ab import engine

    _fake_engine(monkeypatch, {name: [[1]] for name in ("plain", "dflash")})
    events = []
    monkeypatch.setattr(engine, "launch", lambda server, record: events.append(("launch", record["log"])))
    monkeypatch.setattr(engine, "stop", lambda server, record: events.append(("stop", record["log"])))
    monkeypatch.setattr(
        engine, "open_gate", lambda server, record, timeout: events.append(("open", record["log"]))
    )
    monkeypatch.setattr(
        engine.Engine, "_past_deadline", lambda self: sum(e[0] == "stop" for e in events) >= 2
    )
    argv = _argv(tmp_path, "--arms", "plain,dflash,dflash+again", "--schedule", "alternating")
    ab.main([*argv, "--starts", "1", "--prelaunch", "--time-limit", "1"])
    plain, dflash, again = (
        str(tmp_path / "raw" / f"server_{n}_s0.log") for n in ("plain", "dflash", "dflash-again")
    )
    assert events == [
        ("launch", plain),
        ("launch", dflash),  # held while plain measures
        ("stop", plain),
        ("open", dflash),
        ("launch", again),  # held while dflash measures
        ("stop", dflash),
        ("stop", again),  # its turn came past the limit: never let in
    ]
    report = _series(tmp_path, "fake_h200_ab")
    assert report["settings"]["prelaunch"] is True
    assert (
        "Prelaunched: each next server started during the passes before it"
        in (tmp_path / "fake_h200_ab.md").read_text()
    )
    assert report["skipped"] == ["dflash+again start 1: not started, past --time-limit"]
    servers = {a["name"]: a["servers"] for a in report["arms"]}
    assert "gate_port" not in servers["plain"][0] and servers["dflash"][0]["gate_port"] > 0


def test_a_gated_server_is_launched_with_its_gate_port(tmp_path):
    from sglang_ddtree.ab import run

    arm = SimpleNamespace(name="ddtree", server_args=["--model-path", "m"], env={}, servers=[])
    opts = SimpleNamespace(schedule="alternating", raw=tmp_path, start_timeout=10)
    server, record = run.new_server(arm, opts, 1, gated=True)
    at = server.args.index("--gated-launch-port")
    assert int(server.args[at + 1]) == record["gate_port"] != server.port
    plain_server, plain_record = run.new_server(arm, opts, 0)
    assert "--gated-launch-port" not in plain_server.args and "gate_port" not in plain_record


def test_opening_a_gate_lets_the_server_go_on_and_times_its_start_from_there():
    """``open_gate`` posts to the held server's gate (retrying while it is not listening yet) and
    restarts the server's start-up clock there; the time it was held is ``held_seconds``."""
    import http.server
    import threading

    from sglang_ddtree.ab import run
    from sglang_ddtree.launch import free_port

    posts = []

    class Gate(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            posts.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    port = free_port()
    gate = http.server.HTTPServer(("127.0.0.1", port), Gate)
    listening = threading.Timer(1.0, gate.serve_forever)  # the server reaches its gate a second later
    listening.start()
    try:
        server = SimpleNamespace(process=SimpleNamespace(poll=lambda: None))
        record = {"gate_port": port, "launched_at": time.perf_counter() - 5.0}
        run.open_gate(server, record, timeout=30)
    finally:
        gate.shutdown()
        listening.join()
        gate.server_close()
    assert posts == ["/gate/activate"]
    assert 6.0 <= record["held_seconds"] < 30
    assert time.perf_counter() - record["launched_at"] < 1.0  # its start-up counts from the gate


def test_prelaunch_needs_the_alternating_schedule(tmp_path, capsys):
    from sglang_ddtree.ab import cli as ab

    argv = _argv(tmp_path, "--arms", "plain,dflash", "--schedule", "interleaved", "--prelaunch")
    assert ab.main(argv) == 2
    assert "--prelaunch holds the next server of the alternating schedule" in capsys.readouterr().err


def test_parity_difference_is_explained(tmp_path, monkeypatch):
    from sglang_ddtree.ab import cli as ab

    same = {name: [[1]] for name in ("ddtree", "dflash", "plain")}
    _fake_engine(monkeypatch, same, {"ddtree": {"disable_overlap_schedule": True}})
    argv = _argv(tmp_path, "--arms", "plain,dflash,ddtree", "--arm-args", "dflash=--disable-overlap-schedule")
    assert ab.main([*argv, "--strict-parity"]) == 3
    report = _series(tmp_path, "fake_h200_ab")
    (diff,) = report["parity"]["differences"]
    assert diff["key"] == "disable_overlap_schedule"
    assert diff["why"]["ddtree"].startswith("resolved by SGLang")
    assert diff["why"]["dflash"] == "set by --disable-overlap-schedule"
    assert "NOT AT PARITY" in (tmp_path / "fake_h200_ab.md").read_text()


def test_bad_options_are_refused(tmp_path, capsys):
    from sglang_ddtree.ab import cli as ab

    out = ["--results-dir", str(tmp_path)]
    assert ab.main(["--model", "m", "--arms", "ddtree,tree", *out]) == 2
    assert "unknown arm 'tree'" in capsys.readouterr().err
    assert ab.main(["--model", "m", "--arms", "ddtree", *out]) == 2
    assert "needs a drafter" in capsys.readouterr().err
    assert ab.main([*FAKE[:4], "--concurrency", "1,4", "--num-prompts", "1,2,3", *out]) == 2
    assert "one per level" in capsys.readouterr().err
    assert ab.main([*FAKE[:4], "--arms", "plain,ddtree+again", *out]) == 2
    assert "not an arm of the run" in capsys.readouterr().err
    assert ab.main([*FAKE[:4], "--arms", "plain,plain+again", "--arm-env", "plain+again=X=1", *out]) == 2
    assert "an +again arm is a second server of its arm" in capsys.readouterr().err
    assert ab.main([*FAKE[:4], "--arms", "plain", "--arm-env", "plain=NOT-A-VAR", *out]) == 2
    assert "is not VAR=value" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _opts(**kw):
    return Namespace(**{"arms": "plain", "arm_args": [], "arm_env": [], "budget": 32, "block_size": 8, **kw})


def test_arms_variants_env_and_the_chain():
    from sglang_ddtree.ab.arms import build_arms, parse_arm_names
    from sglang_ddtree.adapter.server_args import parse_budget

    assert parse_arm_names("ddtree@8,ddtree@auto,ddtree@auto16,plain,dflash,dflash+again") == [
        ("ddtree@8", "ddtree", 8),
        ("ddtree@auto", "ddtree", "auto"),
        ("ddtree@auto16", "ddtree", "auto16"),
        ("plain", "plain", None),
        ("dflash", "dflash", None),
        ("dflash+again", "dflash", None),
    ]
    opts = _opts(
        arms="ddtree@8,ddtree@auto,ddtree@auto16,ddtree@32,ddtree@32+py,ddtree@32+again,dflash,chain",
        arm_args=["ddtree@32=--speculative-ddtree-stats-interval 5"],
        arm_env=["ddtree@32=A=1", "ddtree@32+py=SGLANG_DDTREE_TREE_BACKEND=python A=2"],
    )
    arms = {arm.name: arm for arm in build_arms(opts, "target", "drafter", [], cpu=False)}

    def flag(args, name):
        return args[args.index(name) + 1]

    assert flag(arms["ddtree@8"].server_args, "--speculative-ddtree-budget") == "8"
    for name, largest in (("ddtree@auto", 32), ("ddtree@auto16", 16)):
        assert parse_budget(flag(arms[name].server_args, "--speculative-ddtree-budget")) == "auto"
        assert flag(arms[name].server_args, "--speculative-num-draft-tokens") == str(largest + 1)
    # a variant: its arm's flags and environment, then its own; +again: exactly its arm's
    assert arms["ddtree@32+again"].server_args == arms["ddtree@32"].server_args
    assert arms["ddtree@32+again"].env == arms["ddtree@32"].env and arms["ddtree@32"].env["A"] == "1"
    assert (
        arms["ddtree@32+py"].env["SGLANG_DDTREE_TREE_BACKEND"] == "python"
        and arms["ddtree@32+py"].env["A"] == "2"
    )
    assert "--speculative-ddtree-stats-interval" in arms["ddtree@32+py"].server_args
    assert "--decode-log-interval" not in arms["ddtree@32"].server_args  # a GPU run keeps SGLang's
    # GPU: dflash is stock DFLASH, chain is DDTREE with one candidate per depth at budget block - 1
    assert flag(arms["dflash"].server_args, "--speculative-algorithm") == "DFLASH"
    assert flag(arms["chain"].server_args, "--speculative-ddtree-max-topk") == "1"
    assert flag(arms["chain"].server_args, "--speculative-ddtree-budget") == "7"
    # CPU: SGLang refuses DFLASH, the chain stands in for it
    cpu = {a.name: a for a in build_arms(_opts(arms="dflash,plain"), "target", "drafter", [], cpu=True)}
    assert flag(cpu["dflash"].server_args, "--speculative-algorithm") == "DDTREE"
    assert "stands in for stock DFLASH" in cpu["dflash"].description
    assert cpu["plain"].env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_schedule_choice_by_memory(monkeypatch):
    from sglang_ddtree.ab import schedule
    from sglang_ddtree.ab.arms import build_arms

    def arms(common, names="plain,dflash,ddtree,dflash+again"):
        return build_arms(_opts(arms=names), "target", "drafter", common, cpu=False)

    cpu_arms = build_arms(_opts(arms="plain,ddtree"), "t", "d", [], cpu=True)
    assert schedule.choose("auto", cpu_arms, True, "t", "d").name == "interleaved"
    fits = schedule.choose("auto", arms(["--mem-fraction-static", "0.2"]), False, "t", "d")
    assert fits.name == "interleaved" and "0.80" in fits.reason and fits.added_args == ["--sleep-on-idle"]
    full = schedule.choose("auto", arms(["--mem-fraction-static", "0.85"]), False, "t", "d")
    assert full.name == "alternating" and "do not fit" in full.reason
    assert (
        schedule.choose("alternating", arms(["--mem-fraction-static", "0.2"]), False, "t", "d").name
        == "alternating"
    )
    # no fraction given: estimated from the weights and the GPU's memory
    monkeypatch.setattr(schedule, "gpu_memory_bytes", lambda: 140 * 2**30)
    monkeypatch.setattr(schedule, "model_bytes", lambda path: 16 * 2**30 if path == "target" else 2**30)
    small = schedule.choose("auto", arms([]), False, "target", "drafter")
    assert small.name == "interleaved" and small.added_args[1] == "--mem-fraction-static"
    assert 0.17 < float(small.added_args[2]) < 0.22  # (0.9 x 140 / 4 - 3) / 140
    many = [*arms([], "plain,dflash,ddtree,dflash+again"), *arms([], "chain,ddtree@8,ddtree@16,ddtree@64")]
    monkeypatch.setattr(schedule, "model_bytes", lambda path: 60 * 2**30)
    assert schedule.choose("auto", many, False, "target", "drafter").name == "alternating"
    monkeypatch.setattr(schedule, "model_bytes", lambda path: None)
    unknown = schedule.choose("auto", arms([]), False, "hub/id", "drafter")
    assert unknown.name == "alternating" and "size is unknown" in unknown.reason
    added = schedule.apply(small, built := arms([]))
    assert added == ["--sleep-on-idle", f"--mem-fraction-static {small.added_args[2]}"]
    assert all(
        a.server_args[-3:] == ["--sleep-on-idle", "--mem-fraction-static", small.added_args[2]] for a in built
    )


def test_local_prompt_rows_token_ids_and_output_lengths(tmp_path):
    """Token-id prompts reach bench_serving as input_ids, each row with its drawn output length."""
    from types import SimpleNamespace

    from sglang_ddtree.ab import bench_worker
    from sglang_ddtree.ab.run import prepare_prompt_rows

    source = tmp_path / "prompts.json"
    source.write_text(json.dumps([{"input_ids": [5, 6, 7], "text": "x"}, {"text": "hello"}, [1, 2]]))
    rows_file, info, prompts = prepare_prompt_rows(str(source), 8, tmp_path / "rows.jsonl", 1, 100, 0.5)
    assert prompts == [[5, 6, 7], "hello", [1, 2]] and info["prompt_kind"] == "text and token ids"
    rows = bench_worker.read_rows(str(rows_file))
    assert len(rows) == 8 and all(50 <= r["output_len"] <= 100 for r in rows)
    assert len({r["output_len"] for r in rows}) > 1  # drawn, not fixed
    again, _, _ = prepare_prompt_rows(str(source), 8, tmp_path / "again.jsonl", 1, 100, 0.5)
    assert again.read_text() == rows_file.read_text()  # the same seed, the same rows

    class Tokenizer:
        bos_token = None

        def encode(self, text):
            return list(range(len(text.split()) + 1))

    module = SimpleNamespace(DatasetRow=lambda **kw: kw)
    served = bench_worker.rows_dataset(module, rows)(SimpleNamespace(num_prompts=10), Tokenizer())
    assert len(served) == 10 and served[8] == served[0]  # cycled, in order
    for row, want in zip(served, rows + rows[:2]):
        assert row["output_len"] == want["output_len"]
        if isinstance(want["prompt"], list):
            assert row["prompt"] == want["prompt"] and row["prompt_len"] == len(want["prompt"])
        else:
            assert row["prompt"] == "hello" and row["prompt_len"] == 2


def test_dry_run_checks_every_arms_flags_with_sglangs_parser(tmp_path, capsys):
    from sglang_ddtree.ab import cli as ab

    pair = Path(__file__).resolve().parents[1] / "lab" / "models" / "pairs" / "pycode-4l"
    argv = ["--model", str(pair / "target"), "--drafter", str(pair / "drafter"), "--device-name", "h200"]
    argv += ["--server-args", "--attention-backend triton --mem-fraction-static 0.08", "--dry-run"]
    argv += [
        "--arms",
        "plain,dflash,chain,ddtree@32,ddtree@auto64,dflash+again",
        "--results-dir",
        str(tmp_path),
    ]
    assert ab.main(argv) == 0
    out = capsys.readouterr().out
    assert "schedule interleaved" in out and "every arm's parse" in out
    assert ab.main([*argv, "--arm-args", "chain=--speculative-ddtree-budjet 3"]) == 2
    assert "chain: " in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_the_load_worker_stands_in_for_optional_packages_a_serving_image_lacks(tmp_path, monkeypatch):
    """The stock load generator imports ``datasets`` (MMMU) and Pillow (images) at its top; a
    serving image may lack them, and the tool uses neither."""
    from sglang_ddtree.ab.bench_worker import import_with_stand_ins

    (tmp_path / "fake_bench_module.py").write_text(
        "from ab_absent_pkg import load_dataset\nimport ab_absent_img.Image\nREADY = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    optional = ("ab_absent_pkg", "ab_absent_img")
    module, stood_in = import_with_stand_ins("fake_bench_module", optional)
    assert module.READY and stood_in == ["ab_absent_pkg", "ab_absent_img", "ab_absent_img.Image"]
    with pytest.raises(ImportError, match="not installed here"):
        module.load_dataset("mmmu")
    (tmp_path / "other_bench_module.py").write_text("import ab_required_pkg\n")
    with pytest.raises(ModuleNotFoundError):  # a package the tool needs is not stood in for
        import_with_stand_ins("other_bench_module", optional)
    for name in [*stood_in, "fake_bench_module"]:
        monkeypatch.delitem(sys.modules, name, raising=False)


# --------------------------------------------------------------------------- diagnostics: ARM+phases, --profile


def test_phase_lines_of_a_server_log():
    from sglang_ddtree.ab.phase_log import phase_means

    text = (
        "[x] WARNING DDTREE phase host us/round: {'draft forward': 300.0, 'build': 40.0, 'round': 900.0}\n"
        "noise\n[x] WARNING DDTREE phase host us/round: {'build': 60.0, 'round': 700.0}\n"
        "[x] WARNING DDTREE phase host us/round: {'build': 5\n"  # a cut line is left out
    )
    # a phase a line lacks did not run in that line's rounds: 0 there
    assert phase_means(text) == {"draft forward": 150.0, "build": 50.0, "round": 800.0}
    assert phase_means("no phase lines\n") is None


def test_the_phases_variant_times_a_ddtree_arm_and_nothing_else():
    from sglang_ddtree.ab.arms import ABError, build_arms

    names = "plain,ddtree@32,ddtree@32+phases,chain+phases,chain"
    arms = {a.name: a for a in build_arms(_opts(arms=names), "target", "drafter", [], cpu=False)}
    assert arms["ddtree@32+phases"].server_args == arms["ddtree@32"].server_args
    own = set(arms["ddtree@32+phases"].env.items()) - set(arms["ddtree@32"].env.items())
    assert own == {("SGLANG_DDTREE_PHASE_TIMES", "50")}
    assert "SGLANG_DDTREE_PHASE_TIMES" not in arms["ddtree@32"].env
    assert "phase" in arms["chain+phases"].description
    own = _opts(arms="ddtree@32,ddtree@32+phases", arm_env=["ddtree@32+phases=SGLANG_DDTREE_PHASE_TIMES=10"])
    assert build_arms(own, "t", "d", [], cpu=False)[1].env["SGLANG_DDTREE_PHASE_TIMES"] == "10"
    for names in ("plain,plain+phases", "dflash,dflash+phases"):  # stock servers have no phase timer
        with pytest.raises(ABError, match="phase timer is DDTREE's"):
            build_arms(_opts(arms=names), "t", "d", [], cpu=False)
    cpu = build_arms(_opts(arms="dflash,dflash+phases"), "t", "d", [], cpu=True)  # the chain stands in
    assert cpu[1].env["SGLANG_DDTREE_PHASE_TIMES"] == "50"


def test_the_heapq_variant_builds_its_arms_tree_on_the_host_and_nothing_else():
    """``ARM+heapq``: the arm's own flags, its tree built by Python's heapq (SGLang's DDTree's
    builder); only a DDTREE arm has a tree builder to swap."""
    from sglang_ddtree.ab.arms import ABError, build_arms

    names = "plain,ddtree@32,ddtree@32+heapq,chain,chain+heapq"
    arms = {a.name: a for a in build_arms(_opts(arms=names), "target", "drafter", [], cpu=False)}
    assert arms["ddtree@32+heapq"].server_args == arms["ddtree@32"].server_args
    own = set(arms["ddtree@32+heapq"].env.items()) - set(arms["ddtree@32"].env.items())
    assert own == {("SGLANG_DDTREE_TREE_BACKEND", "python")}
    assert "SGLANG_DDTREE_TREE_BACKEND" not in arms["ddtree@32"].env | arms["chain"].env
    assert "heapq" in arms["chain+heapq"].description
    for names in ("plain,plain+heapq", "dflash,dflash+heapq"):  # no tree to build
        with pytest.raises(ABError, match="heapq tree builder is DDTREE's"):
            build_arms(_opts(arms=names), "t", "d", [], cpu=False)


def test_a_phases_arm_reports_its_phase_table(tmp_path, monkeypatch):
    from sglang_ddtree.ab import cli as ab

    same = {name: [[1]] for name in ("plain", "ddtree")}
    _fake_engine(monkeypatch, same)
    assert ab.main(_argv(tmp_path, "--arms", "plain,ddtree,ddtree+phases")) == 0
    report = _series(tmp_path, "fake_h200_ab")
    runs = next(a for a in report["arms"] if a["name"] == "ddtree+phases")["runs"]
    # each pass keeps the mean of the lines it added to the log, not the ones before it
    assert [r["phase_host_us"]["build"] for r in runs if r["concurrency_requested"] == 1] == [
        50.0, 50.5, 51.0, 51.5, 52.0
    ]  # fmt: skip
    cells = {(c["arm"], c["concurrency"]): c for c in report["summary"]}
    assert cells[("ddtree+phases", 4)]["phase_host_us"] == {"build": 51.0, "round": 900.0}
    assert "phase_host_us" not in cells[("ddtree", 4)]
    md = (tmp_path / "fake_h200_ab.md").read_text()
    assert "## Host time per round phase (us)" in md and "| ddtree+phases | 4 | 51.0 | 900.0 |" in md


def test_the_phase_table_gives_the_online_budgets_share_of_a_round():
    """Issue 48's measure: the online budget's host work (width choice and record) over the
    worker's round, per cell; absent where the arm has no width phases."""
    from sglang_ddtree.ab.render_diagnostics import md_phases

    def cell(arm, phases):
        return {"arm": arm, "concurrency": 1, "phase_host_us": phases}

    auto = {"draft forward": 300.0, "width choice": 20.0, "width record": 30.0, "round": 2500.0}
    report = {"settings": {"arms": ["ddtree@auto64+phases"]}, "summary": [cell("ddtree@auto64+phases", auto)]}
    md = "\n".join(md_phases(report))
    assert (
        "| online budget % |" in md
        and "| ddtree@auto64+phases | 1 | 300.0 | 20.0 | 30.0 | 2500.0 | 2.0 |" in md
    )
    fixed = {
        "settings": {"arms": ["ddtree@32+phases"]},
        "summary": [cell("ddtree@32+phases", {"round": 900.0})],
    }
    assert "online budget" not in "\n".join(md_phases(fixed))


def test_profile_options_name_an_arm_and_a_level():
    from sglang_ddtree.ab.arms import ABError
    from sglang_ddtree.ab.profiling import parse_specs

    arms, levels = ["plain", "ddtree@32", "ddtree@auto64+width1"], [1, 8]
    assert parse_specs(["ddtree@32@8,plain@1", "ddtree@auto64+width1@1", "plain@1"], arms, levels) == [
        ("ddtree@32", 8),
        ("plain", 1),
        ("ddtree@auto64+width1", 1),
    ]
    assert parse_specs([], arms, levels) == []
    for bad, why in (("ddtree@32", "not an arm"), ("ddtree@16@8", "not an arm"), ("plain@4", "not a level")):
        with pytest.raises(ABError, match=why):
            parse_specs([bad], arms, levels)
    with pytest.raises(ABError, match="expected ARM@CONCURRENCY"):
        parse_specs(["plain@x"], arms, levels)


def _kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def _runtime(name, ts, dur=1.0):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur}


def _span(name, ts, dur, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def _rounds() -> list[dict]:
    """Three DDTREE rounds of 100 us (a drafter forward, then a verify), kernels (two of them
    overlapping), a launch, a graph launch and a sync in each; a prefill before them and idle
    time after."""
    events = [_span("step[EXTEND bs=1 toks=96]", -500.0, 100.0), _kernel("prefill_gemm", -450.0, 50.0)]
    for r in range(3):
        t = 100.0 * r
        events += [
            _span("step[DRAFT bs=2]", t, 20.0),
            _span("step[VERIFY bs=2]", t + 20, 79.0),
            _runtime("cudaGraphLaunch", t),
            _kernel("_fwd_kernel_stage1", t + 2, 20),
            _kernel("ddtree_topk_split_bf16", t + 10, 20),  # overlaps the attention kernel
            _kernel("void cutlass_gemm", t + 40, 10),
            _runtime("cudaLaunchKernel", t + 60),
            _runtime("cudaStreamSynchronize", t + 70, 29.0),
            _span("ddtree.build", t + 5, 8.0),
            _span("ddtree.build", t + 10, 20.0, cat="gpu_user_annotation"),
        ]
    return events + [_runtime("cudaStreamSynchronize", 5000.0, 1.0)]


def test_a_trace_is_summarised_per_round_over_the_profiled_rounds(tmp_path):
    import gzip

    from sglang_ddtree.ab.profiling import categorise, summarise_trace

    path = tmp_path / "1.0-TP-0.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _rounds()}, f)
    s = summarise_trace(str(path), steps=20)
    # whole rounds, from the first verify's start (20 us) to the last one's (220 us): two; the
    # prefill before them and the idle time after them are left out
    assert s["rounds"] == 2 and s["round_us"] == 100.0
    assert s["gpu_busy_us"] == 38.0  # the union of the kernels: 40..50, 102..130, 140..150, 202..230
    assert s["gpu_idle_us"] == 62.0
    assert s["gpu_us_by_category"] == {"attention": 20.0, "draft top-k": 20.0, "gemm": 10.0}
    assert s["graph_launches_per_round"] == 1 and s["kernel_launches_per_round"] == 1
    assert s["host_syncs_per_round"] == 1 and s["kernels_per_round"] == 3
    assert s["phase_host_us"] == {"build": 8.0} and s["phase_gpu_us"] == {"build": 20.0}
    assert s["forwards"] == {"step[EXTEND bs=1 toks=96]": 1, "step[DRAFT bs=2]": 3, "step[VERIFY bs=2]": 3}
    assert s["trace"] == path.name
    # a trace without SGLang's forward names is taken whole, as the steps asked for
    from sglang_ddtree.ab.profiling import summarise_events

    whole = summarise_events([e for e in _rounds() if not e["name"].startswith("step[")], steps=4)
    assert whole["rounds"] == 4 and whole["round_us"] == pytest.approx((5001.0 + 450.0) / 4, abs=0.05)
    # a CPU server's trace: no kernels, the host's rounds only
    cpu = summarise_events([e for e in _rounds() if e["cat"] == "user_annotation"], steps=4)
    assert cpu["rounds"] == 2 and cpu["round_us"] == 100.0 and "gpu_busy_us" not in cpu
    # the kernel kinds: collectives first (their names hold words the later kinds would claim)
    assert (
        categorise("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
        == "all-reduce"
    )
    assert categorise("void sglang::cross_device_reduce_1stage<float, 2>(sglang::RankData*)") == "all-reduce"
    assert categorise("ncclDevKernel_AllGather_RING_LL(x)") == "other collectives"
    assert categorise("void at::native::reduce_kernel<512, 1>(...)") == "sampling / argmax / softmax"
    assert categorise("ddtree_build_tree_w64") == "tree build + mask"
    assert (
        categorise("void MARLIN_NAMESPACE::Marlin<__nv_bfloat16, 4>(int4 const*)") == "MoE experts + routing"
    )
    assert categorise("vectorized_elementwise_kernel") == "elementwise / norm / other"


class _ProfiledServer:
    """SGLang's endpoints as ``--profile`` uses them: streamed /generate, /start_profile (which
    writes rank 0's and rank 1's traces once its steps are done), /stop_profile (an error when
    the profiler has stopped itself, as SGLang answers)."""

    def __init__(
        self, stream=lambda body: (6, 0.0), still_profiling=lambda stops: False, batch=lambda starts: 2
    ):
        """``stream(body)`` -> (chunks of a /generate answer, seconds before its first);
        ``still_profiling(n)``: whether the profiler still runs at the ``n``-th /stop_profile
        (the requests ended before its steps did: the stop succeeds); ``batch(n)``: the batch
        size of the rounds in the trace of the ``n``-th /start_profile."""
        import http.server
        import threading

        calls = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server API
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                calls.append((self.path, body))
                if self.path == "/generate":
                    chunks, delay = stream(body)
                    self.send_response(200)
                    self.end_headers()
                    time.sleep(delay)
                    for i in range(chunks):
                        self.wfile.write(f'data: {{"text": "{i}"}}\n\n'.encode())
                        self.wfile.flush()
                        time.sleep(0.05)
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                if self.path == "/start_profile":
                    out = Path(body["output_dir"])
                    size = batch(sum(path == "/start_profile" for path, _ in calls))
                    events = [{**e, "name": e["name"].replace("bs=2]", f"bs={size}]")} for e in _rounds()]
                    for rank in (1, 0):
                        with open(out / f"7.5-TP-{rank}.trace.json", "w") as f:
                            json.dump({"traceEvents": events[: None if rank == 0 else 3]}, f)
                    reply, code = b"Start profiling.\n", 200
                elif still_profiling(sum(path == "/stop_profile" for path, _ in calls)):
                    reply, code = b"Stop profiling.\n", 200
                else:  # /stop_profile
                    reply, code = b"Profiling is not in progress.", 500
                self.send_response(code)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.calls = calls
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_profile_starts_once_every_request_decodes_and_reads_rank_0s_trace(tmp_path):
    from sglang_ddtree.ab.profiling import profile_level

    fake = _ProfiledServer(batch=lambda starts: 3)
    try:
        s = profile_level(fake.url, [[1, 2], "text"], 3, tmp_path / "p", steps=7, max_new_tokens=33)
    finally:
        fake.server.shutdown()
    paths = [path for path, _ in fake.calls]
    # three streamed requests first, then the profiler (every request past its first token), then
    # the stop once they ended
    assert sorted(paths[:3]) == ["/generate"] * 3 and paths[3:] == ["/start_profile", "/stop_profile"]
    generate = [body for path, body in fake.calls if path == "/generate"]
    assert {json.dumps(b.get("input_ids", b.get("text"))) for b in generate} == {"[1, 2]", '"text"'}
    assert all(b["stream"] and b["sampling_params"]["max_new_tokens"] == 33 for b in generate)
    start = dict(fake.calls)["/start_profile"]
    assert start["num_steps"] == 7 and start["with_stack"] is False and start["record_shapes"] is False
    assert s["trace"] == "7.5-TP-0.trace.json" and s["rounds"] == 2 and "error" not in s
    # a server that cannot profile: the summary says so, and nothing raises
    down = profile_level("http://127.0.0.1:9", [[1]], 1, tmp_path / "q", steps=2, timeout=5)
    assert "error" in down


def test_a_profile_whose_request_ended_first_is_tried_again_with_more_tokens(tmp_path):
    from sglang_ddtree.ab.profiling import ATTEMPTS, profile_level

    def stream(body):  # the text prompt's request ends at its first token below 64 tokens
        short = "text" in body and body["sampling_params"]["max_new_tokens"] < 64
        return (1, 0.0) if short else (6, 0.3)

    fake = _ProfiledServer(stream)
    try:
        s = profile_level(fake.url, [[1, 2], "text"], 2, tmp_path / "p", steps=7, max_new_tokens=20)
    finally:
        fake.server.shutdown()
    paths = [path for path, _ in fake.calls]
    tokens = [body["sampling_params"]["max_new_tokens"] for path, body in fake.calls if path == "/generate"]
    # 20 tokens: the profiler never started; 40: not either; 80: both decoded together under it
    assert tokens == [20, 20, 40, 40, 80, 80] and paths.count("/start_profile") == 1, fake.calls
    assert "error" not in s and s["max_new_tokens"] == 80 and s["rounds"] == 2
    # never together: the error says how hard it tried
    fake = _ProfiledServer(lambda body: (1, 0.0) if "text" in body else (6, 0.3))
    try:
        s = profile_level(fake.url, [[1, 2], "text"], 2, tmp_path / "q", steps=7, max_new_tokens=20)
    finally:
        fake.server.shutdown()
    assert s == {"error": f"a request ended before the profiler started ({ATTEMPTS} tries, up to 80 tokens)"}
    assert [path for path, _ in fake.calls].count("/start_profile") == 0
    # the requests ended before the profiler's steps did (it was still running at the stop): once
    # more with twice the tokens, the trace of that try; cut short every time, it says so
    fake = _ProfiledServer(still_profiling=lambda stops: stops == 1)
    try:
        s = profile_level(fake.url, [[1, 2]], 2, tmp_path / "r", steps=7, max_new_tokens=20)
    finally:
        fake.server.shutdown()
    assert [path for path, _ in fake.calls].count("/start_profile") == 2, fake.calls
    assert s["max_new_tokens"] == 40 and "cut_short" not in s and s["trace"] == "7.5-TP-0.trace.json"
    assert (tmp_path / "r" / "try-2" / "7.5-TP-0.trace.json").exists()
    fake = _ProfiledServer(still_profiling=lambda stops: True)
    try:
        s = profile_level(fake.url, [[1, 2]], 2, tmp_path / "s", steps=7, max_new_tokens=20)
    finally:
        fake.server.shutdown()
    assert s["cut_short"] is True and s["max_new_tokens"] == 80 and s["rounds"] == 2
    # a request ended while the profiler ran (its rounds show one request of two): once more
    # with twice the tokens, the trace of that try
    fake = _ProfiledServer(batch=lambda starts: 1 if starts == 1 else 2)
    try:
        s = profile_level(fake.url, [[1, 2]], 2, tmp_path / "t", steps=7, max_new_tokens=20)
    finally:
        fake.server.shutdown()
    assert [path for path, _ in fake.calls].count("/start_profile") == 2, fake.calls
    assert s["max_new_tokens"] == 40 and "cut_short" not in s
    assert "step[VERIFY bs=2]" in s["forwards"] and "step[VERIFY bs=1]" not in s["forwards"]


def test_profiles_go_into_the_series_after_their_levels_passes(tmp_path, monkeypatch):
    from sglang_ddtree.ab import cli as ab
    from sglang_ddtree.ab import engine

    same = {name: [[1]] for name in ("plain", "ddtree")}
    _fake_engine(monkeypatch, same)
    calls = []

    def profile_level(url, prompts, concurrency, out_dir, **kw):
        calls.append((out_dir.name, concurrency, kw["steps"], kw["max_new_tokens"], len(prompts)))
        if out_dir.name.startswith("plain"):
            return {"error": "no complete trace"}
        return {"trace": "t.json.gz", "rounds": 9, "round_us": 1500.0, "gpu_busy_us": 1200.0,
                "gpu_idle_us": 300.0, "gpu_us_by_category": {"all-reduce": 100.0, "gemm": 900.0},
                "kernel_launches_per_round": 3.0, "graph_launches_per_round": 2.0, "host_syncs_per_round": 1.0,
                "device_to_host_copies_per_round": 1.0, "forwards": {"step[VERIFY bs=4]": 9},
                "phase_host_us": {"build": 40.0}, "phase_gpu_us": {}, "max_new_tokens": 512,
                "cut_short": True}  # fmt: skip

    monkeypatch.setattr(engine, "profile_level", profile_level)
    argv = _argv(tmp_path, "--arms", "plain,ddtree", "--profile", "ddtree@4,plain@1", "--profile-steps", "9")
    assert ab.main(argv) == 0
    assert calls == [("plain_c1", 1, 9, 256, 8), ("ddtree_c4", 4, 9, 256, 8)]  # the built-in prompts
    report = _series(tmp_path, "fake_h200_ab")
    assert (
        report["settings"]["profile"] == ["ddtree@4", "plain@1"] and report["settings"]["profile_steps"] == 9
    )
    arms = {a["name"]: a for a in report["arms"]}
    assert arms["ddtree"]["profiles"][0]["concurrency"] == 4 and arms["ddtree"]["profiles"][0]["rounds"] == 9
    assert arms["plain"]["profiles"][0]["error"] == "no complete trace"
    md = (tmp_path / "fake_h200_ab.md").read_text()
    assert (
        "| ddtree | 4 | 9 | 1500.0 | 1200.0 | 300.0 | 3.0 | 2.0 | 2.0 | 100.0 | gemm 900, all-reduce 100 |"
        in md
    )
    assert "| plain | 1 | failed: no complete trace |" in md and "`step[VERIFY bs=4]` x9" in md
    # a profile that took more tokens, and still ended before the profiler's steps, says so
    assert "`t.json.gz`; 512 tokens a request; the requests ended before the profiler's steps" in md
    # alternating: the profile of the arm's first server only
    calls.clear()
    argv += ["--schedule", "alternating", "--starts", "2", "--repeats", "2"]
    assert ab.main(argv) == 0
    assert [c[0] for c in calls] == ["plain_c1", "ddtree_c4"]
    # a profile of an arm or a level the run does not have is refused before anything starts
    assert ab.main(_argv(tmp_path, "--arms", "plain,ddtree", "--profile", "ddtree@8")) == 2


def test_the_first_pass_waits_for_the_wait_file(tmp_path, monkeypatch):
    import threading

    from sglang_ddtree.ab import cli as ab

    same = {name: [[1]] for name in ("plain", "ddtree")}
    _fake_engine(monkeypatch, same)
    flag = tmp_path / "suite-done"
    threading.Timer(1.5, flag.touch).start()
    assert ab.main(_argv(tmp_path, "--arms", "plain,ddtree", "--wait-file", str(flag))) == 0
    report = _series(tmp_path, "fake_h200_ab")
    assert report["timing"]["waited_for_file_seconds"] >= 1.0 and report["settings"]["wait_file"] == str(flag)
    assert all(len(a["runs"]) == 10 for a in report["arms"])


def test_text_endpoint_is_read_as_text():
    """SGLang's /start_profile answers plain text: reading it as JSON lost every profile."""
    import http.server
    import threading

    from sglang_ddtree.launch import http_json, http_text

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server API
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b"Start profiling.\n" if self.path == "/start_profile" else b'{"ok": 1}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert http_text(f"{url}/start_profile", {"num_steps": 2}) == "Start profiling.\n"
        assert http_json(f"{url}/other", {}) == {"ok": 1}
    finally:
        server.shutdown()


def test_host_load_counts_the_processes_that_name_the_marker():
    """``stamp.host_load``: the host beside a timed cell (load average, processes of a marker)."""
    import uuid

    from sglang_ddtree.ab.stamp import host_load

    marker = f"host-load-test-{uuid.uuid4().hex}"
    key = f"{marker}_processes"
    assert host_load(marker)[key] == 0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        # until the child has exec'd, /proc shows it under this process's command line
        deadline = time.monotonic() + 30.0
        while (seen := host_load(marker))[key] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen[key] == 1 and seen["load_1m"] >= 0.0
    finally:
        child.kill()
        child.wait()
    assert host_load(marker)[key] == 0


def _arm_with_passes(name: str, passes: list[tuple[float, float]]):
    """An arm whose passes at c=1 made these (tok/s, median TPOT ms; a speculative arm's median ITL
    a tenth of its TPOT, as its median over tokens can be)."""
    from sglang_ddtree.ab.arms import Arm, split_variant

    base, variant = split_variant(name)
    kind = base.split("@")[0]
    arm = Arm(name=name, kind=kind, description="", server_args=[], base=base, variant=variant)
    arm.runs = [
        {
            "concurrency_requested": 1,
            "num_prompts": 8,
            "start": 0,
            "repeat": i,
            "completed": 8,
            "output_throughput": tok,
            "median_itl_ms": tpot if kind == "plain" else tpot / 10,
            "median_tpot_ms": tpot,
            "median_ttft_ms": 10.0,
            "p99_ttft_ms": 20.0,
            "accept_length": None,
        }
        for i, (tok, tpot) in enumerate(passes)
    ]
    return arm


def test_decode_pace_is_paired_and_judged_apart_from_tok_s():
    """The pace comparison pairs the passes' 1 / TPOT, against the A/A spread of the pace: an arm
    that makes more tok/s at the same decode pace (its prefills cheaper, say) wins on tok/s and
    not on pace, and one whose steps are 10% slower loses on pace though tok/s cannot tell."""
    from sglang_ddtree.ab import report

    plain = _arm_with_passes("plain", [(100, 2.0), (120, 2.0), (90, 2.0), (110, 2.0)])
    again = _arm_with_passes("plain+again", [(100, 2.02), (120, 1.98), (90, 2.0), (110, 2.01)])
    faster = _arm_with_passes("ddtree", [(200, 2.0), (240, 2.0), (180, 2.0), (220, 2.0)])
    slower = _arm_with_passes("chain", [(95, 2.2), (130, 2.2), (85, 2.2), (115, 2.2)])
    arms = [plain, faster, slower, again]
    cells = report.summarise(arms, "plain")
    _, by_tok = report.comparisons(arms, "plain", cells)
    _, by_pace = report.comparisons(arms, "plain", cells, report.decode_pace)
    tok = {(r["arm"], r["reference"]): r for r in by_tok}
    pace = {(r["arm"], r["reference"]): r for r in by_pace}
    assert tok[("ddtree", "plain")]["verdict"] == "wins" and tok[("ddtree", "plain")][
        "ratio"
    ] == pytest.approx(2.0)
    assert pace[("ddtree", "plain")]["ratio"] == pytest.approx(1.0)
    assert pace[("ddtree", "plain")]["verdict"] == "unresolved"
    assert pace[("chain", "plain")]["ratio"] == pytest.approx(2.0 / 2.2)
    assert pace[("chain", "plain")]["verdict"] == "loses", pace[("chain", "plain")]
    assert tok[("chain", "plain")]["verdict"] == "unresolved"
    # a pass without a TPOT (no request made a second token) pairs with nothing
    plain.runs[0]["median_tpot_ms"] = None
    ratios, _ = report.pair_samples(faster, plain, 1, report.decode_pace)
    assert len(ratios) == 3
