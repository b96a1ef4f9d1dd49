"""Paired passes: the ratio of two arms with an interval, and the verdict on it.

The A/B tool runs every arm's passes paired: in the interleaved schedule repeat ``i`` runs
pass ``i`` of every arm, close in time, so a slow spell of the host hits both passes of a
pair alike; in the alternating schedule start ``s`` of one arm pairs with start ``s`` of the
other, pass for pass. The ratio of a pair is one sample of the arms' ratio; the median paired
ratio is the estimate and a percentile bootstrap over the pairs gives its interval (whole
starts resampled first where the pairs come from several starts: passes of one start share
that start's luck).

A verdict needs more than an interval that excludes 1: two servers of the very same
configuration differ on their own (on the H200 up to 1.25x at c=16, and 1.34x between starts
of the K2.6 rank). The run measures that A/A spread itself (an ``X+again`` arm: a second
server of arm ``X``), and a pair ``wins`` or ``loses`` only where its interval excludes 1 and
lies outside the A/A spread of the same run; else it is ``unresolved``.
"""

from __future__ import annotations

import numpy as np

COVERAGE = 0.9  # the interval's share of the bootstrap's medians
RESAMPLES = 4000
MIN_PAIRS = 3  # fewer pairs say nothing about the spread
UNRESOLVED = "unresolved"
WINS, LOSES = "wins", "loses"


def paired_ratios(passes: list[float], other: list[float]) -> np.ndarray:
    """Each repeat's pass of one arm over the same repeat's pass of the other."""
    n = min(len(passes), len(other))
    return np.asarray(passes[:n], dtype=np.float64) / np.asarray(other[:n], dtype=np.float64)


def median_interval(ratios, coverage: float = COVERAGE, seed: int = 0, groups=None) -> tuple[float, float]:
    """The percentile bootstrap interval of the median of ``ratios`` (each pair resampled whole).

    ``groups`` (one label per ratio, e.g. the server start it came from): a two-level
    bootstrap, whole groups drawn first and then pairs within each drawn group, so that pairs
    sharing a start are not counted as independent evidence."""
    ratios = np.asarray(ratios, dtype=np.float64)
    rng = np.random.default_rng(seed)
    if groups is None or len(set(groups)) < 2:
        picks = rng.integers(0, len(ratios), size=(RESAMPLES, len(ratios)))
        medians = np.median(ratios[picks], axis=1)
    else:
        members = [np.flatnonzero(np.asarray(groups) == g) for g in dict.fromkeys(groups)]
        medians = np.empty(RESAMPLES)
        for i in range(RESAMPLES):
            chosen = [members[k] for k in rng.integers(0, len(members), size=len(members))]
            sample = np.concatenate([m[rng.integers(0, len(m), size=len(m))] for m in chosen])
            medians[i] = np.median(ratios[sample])
    tail = 50 * (1 - coverage)
    low, high = np.percentile(medians, [tail, 100 - tail])
    return float(low), float(high)


def judge(passes: list[float] | None, other: list[float] | None, ratio: float, goal: float):
    """``(measured text, met)`` for ``ratio >= goal``: with enough paired passes the text adds
    the interval, and ``met`` is True or False only where the interval lies on one side of the
    goal (else :data:`UNRESOLVED`); without them, the point ratio decides."""
    if not passes or not other or min(len(passes), len(other)) < MIN_PAIRS:
        return f"{ratio:.3f}", ratio >= goal
    low, high = median_interval(paired_ratios(passes, other))
    text = f"{ratio:.3f} [{low:.3f}, {high:.3f}]"
    if low >= goal:
        return text, True
    if high < goal:
        return text, False
    return text, UNRESOLVED


def compare(ratios, groups=None) -> dict:
    """The median of ``ratios`` (one per pair of passes) and its interval (``None`` with fewer
    than two pairs)."""
    ratios = [float(r) for r in ratios]
    if not ratios:
        return {"ratio": None, "interval": None, "pairs": 0}
    median = float(np.median(ratios))
    interval = list(median_interval(ratios, groups=groups)) if len(ratios) >= 2 else None
    return {"ratio": median, "interval": interval, "pairs": len(ratios)}


def aa_band(intervals: list[list[float] | None]) -> list[float] | None:
    """The A/A spread as a band around 1: the widest of the A/A pairs' intervals, made symmetric
    (which server of an A/A pair is the "again" one is arbitrary, so a ratio ``r`` apart also
    means ``1/r`` apart). ``None`` where no A/A interval was measured."""
    intervals = [iv for iv in intervals if iv]
    if not intervals:
        return None
    low = min(min(lo, 1.0 / hi) for lo, hi in intervals)
    high = max(max(hi, 1.0 / lo) for lo, hi in intervals)
    return [low, high]


def verdict(interval: list[float] | None, pairs: int, band: list[float] | None) -> tuple[str, str]:
    """``(verdict, why)``: :data:`WINS` / :data:`LOSES` only where ``interval`` excludes 1 and
    lies wholly outside the A/A ``band``; else :data:`UNRESOLVED`, with the reason."""
    if interval is None or pairs < MIN_PAIRS:
        return UNRESOLVED, f"{pairs} pair(s) of passes: at least {MIN_PAIRS} are needed for an interval"
    low, high = interval
    if low <= 1.0 <= high:
        return UNRESOLVED, "the interval includes 1"
    if band is None:
        return UNRESOLVED, "no A/A arm (name one ARM+again): the run's own spread is unknown"
    if low > 1.0:
        if low > band[1]:
            return WINS, "the interval lies above 1 and above the A/A spread"
        return UNRESOLVED, "the interval lies above 1 but overlaps the A/A spread"
    if high < band[0]:
        return LOSES, "the interval lies below 1 and below the A/A spread"
    return UNRESOLVED, "the interval lies below 1 but overlaps the A/A spread"
