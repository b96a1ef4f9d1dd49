"""The Markdown pieces the kernel benchmarks' reports share (``tree_kernels``, ``topk_kernels``):
a head (title, provenance stamp, how it was measured), a targets table and result tables
whose columns are named once, as (row key, header) pairs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lab.bench._stamp import md_table, stamp_markdown

Columns = Sequence[tuple[str, str]]  # (key in a result row, column header)


def head(title: str, method: str, results: Mapping) -> list[str]:
    """The report's first lines: ``# title``, the provenance stamp and how it was measured
    (``method`` with ``{vocab}`` and ``{graph_timing}`` filled in from ``results``)."""
    timing = graph_timing(results["config"])
    return [
        f"# {title}",
        "",
        stamp_markdown(results["stamp"]),
        "",
        method.format(vocab=results["vocab"], graph_timing=timing),
        "",
    ]


def graph_timing(config: Mapping) -> str:
    """How a GPU time was taken, from the run's ``calls`` and ``reps`` arguments."""
    return (
        f"CUDA-graph replay, {config['calls']} launches per graph, time per launch, "
        f"median of {config['reps']} replays"
    )


def section(
    title: str,
    rows: Sequence[Mapping],
    columns: Columns,
    where: Mapping | None = None,
    intro: str | None = None,
) -> list[str]:
    """``## title`` (then ``intro``, if any) over a table of ``columns`` of the rows matching
    every ``where`` item. A row without one of the columns shows ``-`` there (optional
    measurements)."""
    picked = [
        tuple(row.get(key, "-") for key, _ in columns)
        for row in rows
        if all(row.get(k) == v for k, v in (where or {}).items())
    ]
    lines = [f"## {title}", ""]
    if intro:
        lines += [intro, ""]
    return [*lines, md_table([header for _, header in columns], picked), ""]


def targets_section(title: str, targets: Mapping[str, dict], columns: Columns) -> list[str]:
    """The targets table: one row per target, with its ``name`` and ``status`` (met, MISSED,
    or ``-`` for a target only reported) beside the target's own keys."""
    rows = [{**t, "name": name, "status": status(t.get("met"))} for name, t in targets.items()]
    return section(title, rows, columns)


def status(met: bool | None) -> str:
    return {True: "met", False: "MISSED"}.get(met, "-")
