"""Issue 18's goals judged again on the round benchmark's committed results, by their paired
passes (``paired.py``): which cells a run resolved, and which it could not.

    python -m lab.bench.online_budget_judged results/pycode-4l_h200_rounds*.json
    # -> results/online_budget_judged_<device>.{json,md}

Each file is one :mod:`.gpu_rounds` run; its ``ddtree@auto`` arms are judged against the
best fixed budget and plain of the same run, as its own report does since the paired
judgement (runs before it reported the point ratio alone).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lab.bench import _stamp
from lab.bench.gpu_rounds_report import levels_by_arm, online_budget_targets
from lab.bench.paired import UNRESOLVED


def judged_runs(paths: list[Path]) -> list[dict]:
    """Per run with an online-budget arm: its commit and its goal rows."""
    runs = []
    for path in paths:
        results = json.loads(path.read_text())
        rows = [row for row in online_budget_targets(levels_by_arm(results)) if row[2] != "(not a goal)"]
        if rows:
            commit = results.get("stamp", {}).get("commit", "")[:7]
            runs.append({"file": path.name, "commit": commit, "rows": rows})
    return runs


def to_markdown(stamp: dict, runs: list[dict]) -> str:
    lines = [
        "# The online budget's goals, judged by the paired passes",
        "",
        _stamp.stamp_markdown(stamp),
        "",
        "Each run's `ddtree@auto` arm over the best fixed budget and plain of the same run. "
        "`measured`: the ratio of the arms' median passes [the 90% bootstrap interval of the "
        "median of the repeats' paired ratios]; `met` only where the interval lies on one side "
        "of the goal (`bench/paired.py`).",
    ]
    for run in runs:
        counts = {
            verdict: sum(row[3] == verdict for row in run["rows"]) for verdict in (True, False, UNRESOLVED)
        }
        lines += [
            "",
            f"## `{run['file']}` ({run['commit']}): met {counts[True]}, missed {counts[False]}, "
            f"unresolved {counts[UNRESOLVED]}",
            "",
            _stamp.md_table(["ratio", "measured", "goal", "met"], run["rows"]),
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="gpu_rounds result files (.json)")
    p.add_argument("--out", default=None, help="results folder (default: results)")
    args = p.parse_args(argv)
    runs = judged_runs(args.results)
    stamp = _stamp.stamp()
    name = f"online_budget_judged_{_stamp.device_slug(stamp)}"
    results = {"stamp": stamp, "runs": runs}
    for path in _stamp.write_outputs(_stamp.results_dir(args.out), name, results, to_markdown(stamp, runs)):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
