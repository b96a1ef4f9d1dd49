"""When a width-1 step of the online budget drafts anyway, to predict anew (``widths.py``).

A width-1 step that skips the drafter predicts nothing and keeps the last prediction. Some
width-1 steps draft anyway, so that the kept prediction follows the requests that come and go:

* the first once half the batch joined after the kept prediction was made: requests it knows
  nothing of (the trained pair's server once ran 70 width-1 steps without the drafter in its
  first 1,000, 40 in a row in its first requests, on a prediction one request left to the
  next). One request joining a batch of 64 leaves the prediction as it was: drafting for it at
  every prefill would cost a drafter forward a few steps apart;
* one after a run of steps without a draft. The run is short after a tree step
  (``first_refresh`` steps) and doubles at each refresh that keeps width 1, up to
  ``refresh_every``. One drafted step's prediction is noisy, and a low one that chose width 1
  would otherwise hold the batch at width 1 for ``refresh_every`` steps (on the H200 the pair's
  ``auto64`` ran a quarter of its steps at 4 requests at width 1, at a level where a fixed tree
  served 1.4x its tokens a second); a batch that belongs at width 1 soon drafts only once in
  ``refresh_every``;
* a cost probe's width 1 (no prediction chose it): one after ``refresh_every``.

``refresh_every`` 0 (benchmarks: ``$SGLANG_DDTREE_ONLINE_BUDGET_REFRESH_EVERY``): none drafts once a
prediction is made, so a run at width 1 measures the width-1 step alone.
"""

from __future__ import annotations

FIRST_REFRESH = 2  # width-1 steps without a draft, after a tree step, before one drafts
REFRESH_EVERY = 64  # the longest such run


class Refresh:
    def __init__(self, refresh_every: int = REFRESH_EVERY, first_refresh: int = FIRST_REFRESH):
        self.refresh_every = refresh_every
        self.first = min(first_refresh, refresh_every)
        self.after = self.first  # the run of steps without a draft that a refresh ends
        self.run = 0  # width-1 steps without a draft since the last step that drafted
        self.joined = 0  # requests prefilled since the last prediction

    def due(self, bs: int, probed: bool) -> bool:
        """Whether a width-1 step of ``bs`` requests on the kept prediction drafts to predict anew."""
        if not self.refresh_every:
            return False
        return self.run >= (self.refresh_every if probed else self.after) or 2 * self.joined >= bs

    def step(self, width: int, skipped_draft: bool, probed: bool) -> None:
        """After a step's choice: a tree step re-arms the short run; a refresh that kept width 1
        doubles it (a probe's width does neither)."""
        if not probed:
            if width != 1:
                self.after = self.first
            elif not skipped_draft and self.run >= self.after:
                self.after = min(2 * self.after, self.refresh_every)
        self.run = self.run + 1 if skipped_draft else 0
