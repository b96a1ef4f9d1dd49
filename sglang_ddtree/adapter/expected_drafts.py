"""What the online budget expects a batch to accept at each candidate width (``widths.py``).

``start`` must not wait for the device, so it chooses from the last landed prediction: the
drafter's reach per request at every candidate width and depth (``tree/expected_accept.py``),
scaled to this step's batch size (acceptance moves slowly, the batch size is known on the
host) and calibrated per depth against what the target accepted (``budget/calibration.py``).
A predicting step's values, once landed on the host, are folded in here: they replace the
prediction and update the calibration.

The expected drafts of a batch size are kept until the next fold, as one read-only array: a
step that reads the same array as the last one knows nothing moved (``budget/decisions.py``
compares them by identity).
"""

from __future__ import annotations

import numpy as np

from ..budget import DepthCalibration


class ExpectedDrafts:
    def __init__(self, widths, depth: int):
        self.widths = tuple(widths)
        self._column = {width: column for column, width in enumerate(self.widths)}
        self.calibration = DepthCalibration(depth)
        self._per_request: np.ndarray | None = None  # [n_widths, depth] reach per request
        self._of_batch: dict[int, np.ndarray] = {}  # batch size -> its expected drafts per width

    @property
    def per_request(self) -> np.ndarray | None:
        """``[n_widths, depth]``: the last landed prediction per request (None: none landed)."""
        return self._per_request

    @per_request.setter
    def per_request(self, reach: np.ndarray | None) -> None:
        self._per_request, self._of_batch = reach, {}

    def of_batch(self, bs: int) -> np.ndarray:
        """``[n_widths]``: the batch's calibrated expected accepted drafts per width (read only).
        Before any prediction has landed nothing is expected (the smallest width wins)."""
        accepted = self._of_batch.get(bs)
        if accepted is None:
            per_request = self._per_request
            if per_request is None:
                accepted = np.zeros(len(self.widths))
            else:
                accepted = self.calibration.calibrated(per_request * bs)
            accepted.flags.writeable = False
            self._of_batch[bs] = accepted
        return accepted

    def fold(self, values: np.ndarray, width: int, bs: int) -> None:
        """A predicting step's landed values ``[n_widths + 1, depth]`` (its reach at every width,
        then the depths its batch of ``bs`` reached at ``width``, the width it ran): into the
        calibration, and the prediction the next choices scale."""
        predicted, measured = values[:-1], values[-1]
        self.calibration.update(measured, predicted[self._column[width]])
        self.per_request = predicted / bs  # a copy: the host buffer can take the next prediction
