"""Whether a benchmark's ratio between two arms resolves a goal, from the arms' paired passes.

:mod:`.gpu_rounds` runs every arm's timed passes interleaved: repeat ``i`` runs pass ``i`` of
each arm, close in time, so a slow spell of the host hits both passes of a pair alike. The
ratio of a pair is one sample of the arms' ratio; over the repeats, the median paired ratio is
the estimate and a bootstrap over the repeats gives its interval. A goal such as "within 5% of
the best fixed budget" is met or missed only where that interval lies on one side of it; in
between the run does not resolve it (on the trained pair the passes of one cell have spread
1.15-2.75x, ``bench_results/gpu_rounds_pycode-4l_h200_6125f69.md``).
"""

from __future__ import annotations

import numpy as np

COVERAGE = 0.9  # the interval's share of the bootstrap's medians
RESAMPLES = 4000
MIN_PAIRS = 3  # fewer repeats say nothing about the spread
UNRESOLVED = "unresolved"


def paired_ratios(passes: list[float], other: list[float]) -> np.ndarray:
    """Each repeat's pass of one arm over the same repeat's pass of the other."""
    n = min(len(passes), len(other))
    return np.asarray(passes[:n], dtype=np.float64) / np.asarray(other[:n], dtype=np.float64)


def median_interval(ratios: np.ndarray, coverage: float = COVERAGE, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the median of ``ratios`` (resampled whole: each
    repeat's pair stays a pair)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(ratios), size=(RESAMPLES, len(ratios)))
    medians = np.median(ratios[picks], axis=1)
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
