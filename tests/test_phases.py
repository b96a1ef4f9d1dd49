"""The round's host phase timer (``adapter/phases.py``): off, it records nothing; on, it
reports per-round means over exactly the rounds since its last log line."""

from __future__ import annotations

import logging
import time

from sglang_ddtree.adapter.phases import BETWEEN, RoundPhases


def _round(phases: RoundPhases, sleep_s: float) -> None:
    phases.start_round()
    with phases("draft"):
        time.sleep(sleep_s)
    with phases("verify"):
        pass
    phases.end_round()


def test_off_records_nothing():
    phases = RoundPhases(interval=0, is_logging_rank=True)
    assert phases("draft") is phases("verify")  # one shared no-op context
    _round(phases, 0.0)
    assert phases.rounds == 0 and not phases.totals


def test_only_the_logging_rank_measures():
    phases = RoundPhases(interval=3, is_logging_rank=False)
    _round(phases, 0.0)
    assert not phases.totals


def test_means_per_round_and_log_every_interval(caplog):
    phases = RoundPhases(interval=2, is_logging_rank=True)
    with caplog.at_level(logging.INFO, logger="sglang_ddtree"):
        _round(phases, 0.010)
        _round(phases, 0.030)
    lines = [r.getMessage() for r in caplog.records if "phase host us/round" in r.getMessage()]
    assert len(lines) == 1
    assert not phases.totals  # cleared after the line
    _round(phases, 0.002)
    means = phases.means_us()
    assert 2_000 <= means["draft"] < 8_000  # one round since the log line, not three
    assert means["round"] >= means["draft"] + means["verify"]
    assert BETWEEN in means


def test_idle_gaps_are_not_counted_between_rounds():
    phases = RoundPhases(interval=100, is_logging_rank=True)
    _round(phases, 0.0)
    time.sleep(0.08)  # the server idles
    _round(phases, 0.0)
    assert BETWEEN not in phases.totals
