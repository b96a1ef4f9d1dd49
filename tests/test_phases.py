"""The round's host phase timer (``adapter/phases.py``): off, it records nothing; on, it
reports per-round means over exactly the rounds since its last log line.

Time is a fake clock that only the test advances: on a loaded machine a real 2 ms sleep
took 10 ms, and a test of the arithmetic must not read the machine's load."""

from __future__ import annotations

import logging

import pytest

from sglang_ddtree.adapter import phases as phases_module
from sglang_ddtree.adapter.phases import BETWEEN, IDLE_GAP_S, RoundPhases


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(phases_module, "time", fake)
    return fake


def _round(phases: RoundPhases, clock: FakeClock, draft_s: float, verify_s: float = 0.001) -> None:
    phases.start_round()
    with phases("draft"):
        clock.sleep(draft_s)
    with phases("verify"):
        clock.sleep(verify_s)
    clock.sleep(0.0005)  # the rest of the round
    phases.end_round()
    clock.sleep(0.002)  # the scheduler between rounds


def test_off_records_nothing(clock):
    phases = RoundPhases(interval=0, is_logging_rank=True)
    assert phases("draft") is phases("verify")  # one shared no-op context
    _round(phases, clock, 0.0)
    assert phases.rounds == 0 and not phases.totals


def test_only_the_logging_rank_measures(clock):
    phases = RoundPhases(interval=3, is_logging_rank=False)
    _round(phases, clock, 0.0)
    assert not phases.totals


def test_means_per_round_and_log_every_interval(clock, caplog):
    phases = RoundPhases(interval=2, is_logging_rank=True)
    with caplog.at_level(logging.INFO, logger="sglang_ddtree"):
        _round(phases, clock, 0.010)
        _round(phases, clock, 0.030)
    lines = [r.getMessage() for r in caplog.records if "phase host us/round" in r.getMessage()]
    assert len(lines) == 1
    assert "'draft': 20000.0" in lines[0]  # the mean of the two rounds
    assert not phases.totals  # cleared after the line
    _round(phases, clock, 0.002)
    means = phases.means_us()
    assert means["draft"] == pytest.approx(2_000)  # one round since the log line, not three
    assert means["verify"] == pytest.approx(1_000)
    assert means["round"] == pytest.approx(3_500)  # draft + verify + the rest
    assert means[BETWEEN] == pytest.approx(2_000)


def test_idle_gaps_are_not_counted_between_rounds(clock):
    phases = RoundPhases(interval=100, is_logging_rank=True)
    _round(phases, clock, 0.0)
    clock.sleep(IDLE_GAP_S + 0.03)  # the server idles
    _round(phases, clock, 0.0)
    assert BETWEEN not in phases.totals
    _round(phases, clock, 0.0)  # a busy gap (2 ms) is counted
    assert phases.totals[BETWEEN] == pytest.approx(0.002)


def test_a_phase_is_a_profiler_range_only_while_a_profiler_records(monkeypatch):
    torch = phases_module.torch
    phases = RoundPhases(interval=4, is_logging_rank=True)
    record_function = torch.profiler.record_function
    opened = []
    monkeypatch.setattr(
        torch.profiler, "record_function", lambda name: opened.append(name) or record_function(name)
    )
    with phases("verify"):  # no profiler: no range (it would cost every phase a few us)
        pass
    assert opened == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with phases("verify"):
            torch.ones(2).sum()
    assert opened == ["ddtree.verify"]
    assert "ddtree.verify" in {event.name for event in prof.events()}
