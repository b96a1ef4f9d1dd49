"""One series from ``gpu/jobs/budget_host_ab.sh``'s interleaved runs: each run's cells, the
package it timed (``before``: the copy in ``BEFORE_DIR``; ``after``: this checkout) and its run
number, in one table, with every run's report kept in the JSON.

    python -m lab.bench.online_budget_host_ab OUT NAME --before daa11a3 --after f2b9f40 --command "..."
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from lab.bench import _stamp
from lab.bench.online_budget_host import _served

COLUMNS = [
    ("start (mean)", "start_us_mean"),
    ("start (median)", "start_us"),
    ("start (fold)", "start_us_folding"),
    ("finish (mean)", "finish_us_mean"),
    ("mean per step", "mean_us_per_step"),
]


def runs(out: Path, name: str) -> dict[str, dict]:
    """``{"before_1": report, "after_1": report, ...}`` in the order the job ran them."""
    found = {}
    for path in out.glob(f"{name}_*.json"):
        match = re.fullmatch(rf"{re.escape(name)}_(before|after)_(\d+)\.json", path.name)
        if match:
            found[(int(match[2]), match[1] == "after")] = (
                f"{match[1]}_{match[2]}",
                json.loads(path.read_text()),
            )
    return dict(found[key] for key in sorted(found))


def to_markdown(name: str, command: str, before: str, after: str, reports: dict[str, dict]) -> str:
    rows = []
    for key, report in reports.items():
        package, run = key.split("_")
        for cell in report["cells"]:
            rows.append(
                [package, run, cell["bs"], *(cell[field] for _, field in COLUMNS)]
                + [
                    f"{cell['chosen_steps']} / {cell['steps']}",
                    f"{cell['predicting_steps']} / {cell['steps']}",
                ]
            )
    first = next(iter(reports.values()))
    return "\n".join(
        [
            f"# {name}: the online budget's host time per step, two packages interleaved",
            "",
            _stamp.stamp_markdown({**first["stamp"], "commit": f"{after} (before: {before})"}),
            "",
            f"command: `{command}`",
            "",
            f"`before`: the package at {before}; `after`: at {after}. Each run: "
            + _served(first["config"])
            + "means and medians per step in us (`start (fold)`: the median of the steps that fold a "
            "landed prediction); every run's report is in the JSON (`runs`).",
            "",
            _stamp.md_table(
                ["package", "run", "bs", *(title for title, _ in COLUMNS), "chosen anew", "predicting steps"],
                rows,
            ),
        ]
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the folder the runs were written to (and the series is)")
    p.add_argument("name", help="the runs' common name (NAME_before_1.json, NAME_after_1.json, ...)")
    p.add_argument("--before", required=True, help="the commit of the package timed as before")
    p.add_argument("--after", required=True, help="this checkout's commit")
    p.add_argument("--command", required=True, help="the command that made the runs")
    args = p.parse_args(argv)
    reports = runs(args.out, args.name)
    if not reports:
        p.error(f"no runs named {args.name}_before_N / _after_N in {args.out}")
    data = {"command": args.command, "before": args.before, "after": args.after, "runs": reports}
    markdown = to_markdown(args.name, args.command, args.before, args.after, reports)
    for path in _stamp.write_outputs(args.out, args.name, data, markdown):
        print(path)
    for run in reports:  # exactly the runs folded in: another series may share the name's prefix
        for suffix in (".json", ".md"):
            (args.out / f"{args.name}_{run}{suffix}").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
