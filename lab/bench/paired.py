"""The paired judgement of a benchmark's ratio: now in the package (``sglang_ddtree.ab.paired``,
the A/B tool's), re-exported here for the lab's reports."""

from sglang_ddtree.ab.paired import (  # noqa: F401
    COVERAGE,
    MIN_PAIRS,
    RESAMPLES,
    UNRESOLVED,
    judge,
    median_interval,
    paired_ratios,
)
