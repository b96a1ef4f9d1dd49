"""The online budget: which verify width each decode step should run.

* ``calibration.py`` - per-depth correction of the drafter's predicted acceptance
  (``tree/expected_accept.py``) against what the target accepted, running;
* ``online.py`` - the round cost table ``T_round(bs, width)`` and the chooser that
  picks the width maximising committed tokens per millisecond, with hysteresis;
* ``timed_costs.py`` - the table under CUDA graphs: timed replays, then each width's own
  rounds (probed where the chooser does not run them);
* ``slack.py`` - how far the costs may drift before a choice (or a probe check) could change,
  so that a step keeps the last one until then;
* ``decisions.py`` - a step's probe and width, kept per batch size while that holds.

Pure Python / numpy / torch on the host; ``adapter/widths.py`` drives them per decode step
(choosing from the previous step's prediction, so that no step waits for the device).
Design and SGLang constraints: docs/online-budget.md.
"""

from .calibration import DepthCalibration, reach_counts
from .online import (
    ProbedCostTable,
    RoundCostTable,
    WidthChooser,
    WidthScore,
    candidate_widths,
    score_widths,
)
from .timed_costs import TimedCostTable

__all__ = [
    "DepthCalibration",
    "ProbedCostTable",
    "RoundCostTable",
    "TimedCostTable",
    "WidthChooser",
    "WidthScore",
    "candidate_widths",
    "reach_counts",
    "score_widths",
]
