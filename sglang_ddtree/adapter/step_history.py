"""The steps the online budget ran, per batch size and width (``widths.py``, its summary)."""

from __future__ import annotations

from collections import Counter


class StepHistory:
    """(batch size, width) -> steps run, booked in runs: a step like the last one only counts
    (``StepWidths.start`` compares ``bs`` and ``width`` itself), since a Counter's update of a
    tuple key costs a few us on the cold caches of a served round."""

    def __init__(self):
        self._counts: Counter[tuple[int, int]] = Counter()
        self.bs, self.width, self.run = 0, 0, 0  # the last step's, and the steps like it not booked

    def book(self, bs: int, width: int) -> None:
        """A step of another batch size or width than the last one."""
        self._flush()
        self.bs, self.width, self.run = bs, width, 1

    @property
    def counts(self) -> Counter[tuple[int, int]]:
        self._flush()
        return self._counts

    def _flush(self) -> None:
        if self.run:
            self._counts[self.bs, self.width] += self.run
            self.run = 0
