"""The online budget: which verify width each decode step should run.

* ``calibration.py`` - per-depth correction of the drafter's predicted acceptance
  (``tree/expected_accept.py``) against what the target accepted, running;
* ``controller.py`` - both driven by the worker: ``choose`` before a step, ``record`` after;
* ``online.py`` - the round cost table ``T_round(bs, width)`` and the chooser that
  picks the width maximising committed tokens per millisecond, with hysteresis.

Pure Python / numpy / torch on the host; the worker feeds it per-step totals.
Design and SGLang constraints: docs/online-budget.md.
"""

from .calibration import DepthCalibration, reach_counts
from .controller import OnlineBudget
from .online import (
    ProbedCostTable,
    RoundCostTable,
    TimedCostTable,
    WidthChooser,
    WidthScore,
    candidate_widths,
    score_widths,
)

__all__ = [
    "DepthCalibration",
    "OnlineBudget",
    "ProbedCostTable",
    "RoundCostTable",
    "TimedCostTable",
    "WidthChooser",
    "WidthScore",
    "candidate_widths",
    "reach_counts",
    "score_widths",
]
