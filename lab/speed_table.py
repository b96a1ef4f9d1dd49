"""The README's speed table, generated from the A/B series in ``results/``:
``python -m lab.speed_table`` rewrites the table between its two marker lines in README.md.

Each row is one comparison of one committed series (:data:`ROWS`): per concurrency level, the
median paired ratio of tok/s with its 90% interval, the run's own A/A spread and the tool's
verdict, exactly as the series' JSON holds them. ``tests/test_speed_table.py`` fails when the
README's table is not what this writes from the committed files, so the table cannot drift
from its series.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from sglang_ddtree.ab.paired import MIN_PAIRS

ROOT = Path(__file__).resolve().parent.parent
START = "<!-- speed table: written by python -m lab.speed_table from results/; edits here are replaced -->"
END = "<!-- end of the speed table -->"


@dataclass(frozen=True)
class Row:
    series: str
    arm: str
    reference: str
    what: str


ROWS = (
    Row(
        "pycode-4l_h200_ab_c1",
        "ddtree@32",
        "dflash",
        "trained pair, one H200, 3 servers: DDTREE@32 / stock DFLASH",
    ),
    Row("pycode-4l_h200_ab", "ddtree@64", "dflash", "trained pair, one H200: DDTREE@64 / stock DFLASH"),
    Row("pycode-4l_h200_ab", "ddtree@auto64", "plain", "trained pair, one H200: online budget / plain"),
    Row(
        "pycode-4l_h100_width1_criteria",
        "ddtree@auto64",
        "plain",
        "trained pair, one H100, 4 servers: online budget / plain",
    ),
    Row("k26-rank_h200_ab", "chain", "plain", "one K2.6 TP-8 rank, replayed acceptance: chain / plain"),
    Row("k26-rank_h200_ab", "ddtree@7", "chain", "one K2.6 TP-8 rank, replayed acceptance: DDTREE@7 / chain"),
    Row(
        "k26-rank_h200_ab", "ddtree@32", "chain", "one K2.6 TP-8 rank, replayed acceptance: DDTREE@32 / chain"
    ),
    Row(
        "k26-rank_h200_ab",
        "ddtree@auto7",
        "chain",
        "one K2.6 TP-8 rank, replayed acceptance: online budget / chain",
    ),
)


def _interval(iv) -> str:
    return f"[{iv[0]:.2f}, {iv[1]:.2f}]" if iv else "-"


def level_text(comparison: dict) -> str:
    """One level of a row: ``c=1: 1.28x [1.08, 1.45], A/A [0.79, 1.26], unresolved``."""
    verdict = comparison["verdict"]
    verdict = verdict if verdict == "unresolved" else f"**{verdict}**"
    interval = _interval(comparison.get("interval"))
    if comparison.get("pairs", 0) < MIN_PAIRS:  # the tool gives no interval below 3 pairs
        interval = f"({comparison.get('pairs', 0)} pairs, no interval)"
    return (
        f"c={comparison['concurrency']}: {comparison['ratio']:.2f}x {interval}, "
        f"A/A {_interval(comparison.get('aa_band'))}{_start_spread(comparison)}, {verdict}"
    )


def _start_spread(comparison: dict) -> str:
    """An alternating series' spread between two starts of one arm (the largest of the pair's)."""
    spreads = [s for s in (comparison.get("start_spread") or {}).values() if s is not None]
    return f", start spread {max(spreads):.2f}x" if spreads else ""


def row_text(row: Row, report: dict) -> str:
    found = [
        c
        for c in report["comparisons"]
        if c["arm"] == row.arm and c["reference"] == row.reference and c.get("ratio") is not None
    ]
    if not found:
        raise ValueError(f"{row.series} holds no comparison of {row.arm} with {row.reference}")
    levels = "<br>".join(level_text(c) for c in sorted(found, key=lambda c: c["concurrency"]))
    failed = (
        "" if report.get("greedy_check", {}).get("ok", True) else " (its greedy check failed: see the series)"
    )
    return f"| {row.what} | {levels} | [`{row.series}`](results/{row.series}.md){failed} |"


def table(results: Path, rows=ROWS) -> str:
    """The table, markers included, from the series' JSON files in ``results``."""
    reports = {name: json.loads((results / f"{name}.json").read_text()) for name in {r.series for r in rows}}
    lines = [
        START,
        "| comparison | per concurrency c: ratio of tok/s [90%], A/A spread (alternating: start spread), verdict | series |",
    ]
    lines += ["|---|---|---|", *(row_text(r, reports[r.series]) for r in rows), END]
    return "\n".join(lines)


def replaced(readme: str, new_table: str) -> str:
    if START not in readme or END not in readme:
        raise ValueError("README.md has no speed-table markers")
    head, rest = readme.split(START, 1)
    return head + new_table + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--results", type=Path, default=ROOT / "results")
    args = p.parse_args(argv)
    args.readme.write_text(replaced(args.readme.read_text(), table(args.results)))
    print(f"wrote the speed table of {args.readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
