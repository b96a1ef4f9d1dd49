"""The index of a results folder: ``python -m sglang_ddtree.ab.index results/`` (re)writes the
A/B section of ``results/README.md``: one line per A/B series (``<model>_<device>_<what>.json``)
with its headline numbers: per concurrency level, the fastest arm against the baseline, the
median paired ratio with its 90% interval, the run's A/A spread and the verdict.

The section lies between two marker lines (:data:`START`, :data:`END`); the rest of the README
(an index of other series, written by hand) is kept as it is. A README without the markers
gets the section at its end; a folder without a README gets a page of its own."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .render import _iv, ratio_text

INDEX = "README.md"


def series_reports(folder: Path) -> list[dict]:
    """The A/B reports in ``folder`` (other JSON files are left alone), by series name."""
    out = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if (
            isinstance(report, dict)
            and report.get("tool") == "sglang_ddtree.ab"
            and report.get("format", 1) >= 2
        ):
            report["_path"] = path
            out.append(report)
    return out


def status_text(report: dict) -> str:
    """The run's status, and a failed greedy check beside it (the run itself may have ended ok)."""
    failed = not report.get("greedy_check", {}).get("ok", True)
    return f"{report.get('status')}{', **greedy check failed**' if failed else ''}"


def headline_text(report: dict) -> str:
    parts = []
    for r in report.get("headline", []):
        parts.append(
            f"c={r['concurrency']}: {r['arm']} {ratio_text(r)} vs {r['reference']}, "
            f"A/A {_iv(r.get('aa_band'))}, **{r['verdict']}**"
        )
    return "<br>".join(parts) or "-"


START = "<!-- A/B series: written by python -m sglang_ddtree.ab.index; edits here are replaced -->"
END = "<!-- end of the A/B series -->"


def index_section(reports: list[dict]) -> str:
    """The A/B section, markers included."""
    lines = [
        START,
        "## A/B series",
        "",
        "Written by `python -m sglang_ddtree.ab` (each series' `.md` holds every cell, the A/A and the "
        "exact command). Headline: per concurrency level c, the fastest arm against the baseline: the "
        "median paired ratio of tok/s with its 90% bootstrap interval, the run's own A/A spread, and the "
        "verdict (wins / loses only where the interval excludes 1 and lies outside the A/A spread). "
        "Regenerate with `python -m sglang_ddtree.ab.index <folder>`.",
        "",
        "| series | device | schedule | status | headline | commit | date |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        name = r["_path"].stem
        stamp, settings = r.get("stamp", {}), r.get("settings", {})
        commit = str(stamp.get("commit") or "-")[:12]
        lines.append(
            f"| [{name}]({name}.md) | {stamp.get('device_name') or '-'} | {settings.get('schedule', '-')} | "
            f"{status_text(r)} | {headline_text(r)} | `{commit}` | {str(stamp.get('date_utc') or r.get('date'))[:10]} |"
        )
    if not reports:
        lines.append("| (no series yet) | | | | | | |")
    return "\n".join([*lines, END]) + "\n"


def index_markdown(reports: list[dict], existing: str | None = None) -> str:
    """The README: ``existing`` with its A/B section replaced (or added at its end)."""
    section = index_section(reports)
    if existing is None:
        return "# Results\n\n" + section
    if START in existing and END in existing:
        head, rest = existing.split(START, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        return head + section + ("\n" + tail if tail else "")
    return existing.rstrip("\n") + "\n\n" + section


def write_index(folder: Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / INDEX
    existing = path.read_text() if path.is_file() else None
    path.write_text(index_markdown(series_reports(folder), existing))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?", default="results", type=Path)
    args = p.parse_args(argv)
    print(f"wrote {write_index(args.folder)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
