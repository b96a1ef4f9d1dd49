"""What the online budget shows (``widths.py``): the stats log line's summary and the cost
table's rows. Read every stats interval (or every ``LOG_EVERY`` steps), not per step."""

from __future__ import annotations

from collections import Counter

from ..budget import ProbedCostTable, RoundCostTable, TimedCostTable


def summary(steps) -> dict:
    """For the stats log line: the steps each width served (in all, and per batch size),
    and the per-depth calibration (``steps``: a ``StepWidths``)."""
    per_width: Counter[int] = Counter()
    by_bs: dict[int, dict[int, int]] = {}
    for (bs, width), count in sorted(steps.history.items()):
        per_width[width] += count
        by_bs.setdefault(bs, {})[width] = count
    shown = {
        "width_steps": dict(sorted(per_width.items())),
        "width_steps_by_bs": by_bs,
        "width1_steps_without_draft": steps.steps_without_draft,
        "depth_scale": [round(float(s), 3) for s in steps.expected.calibration.scale],
    }
    if steps.measured:
        shown["round_ms"] = measured_costs(steps.cost)
    if isinstance(steps.cost, TimedCostTable):
        shown |= steps.cost.summary()
    return shown


def measured_costs(table: RoundCostTable) -> dict[int, dict[int, float]]:
    """The measured cost table's rows that rounds have reached: batch size -> width -> ms
    (probed cells; under graphs every width of a served row, as the chooser sees it)."""
    probed = isinstance(table, ProbedCostTable)
    reached = table.counts > 0 if probed else table.rows_served()[:, None].repeat(len(table.widths), axis=1)
    return {
        bs: {w: round(float(ms), 2) for w, ms, cell in zip(table.widths, table.row_costs(bs), cells) if cell}
        for bs, cells in zip(table.batch_sizes, reached)
        if cells.any()
    }


def cost_rows(table: RoundCostTable) -> dict[int, dict[int, float]]:
    """Every row of the cost table: batch size -> width -> ms."""
    return {bs: {w: round(table(bs, w), 3) for w in table.widths} for bs in table.batch_sizes}
