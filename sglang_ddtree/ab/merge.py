"""Several runs of one A/B series as one: ``python -m sglang_ddtree.ab.merge A.json B.json ...
--series NAME [--results-dir DIR]``.

Where one run cannot hold every start (a model that fills the GPU starts in minutes, and a job
has a time limit), each call runs the arms once or twice, and the calls are merged: each call's
servers become the next start indices of their arms, so start ``s`` of one arm still pairs with
start ``s`` of another (servers that ran in the same call, close in time), and the interval
resamples whole starts. The runs must serve the same requests (model, prompts, output lengths,
seed and levels); an arm of the same name must have the same flags and environment in every run.
Runs made in different folders name the same files by different paths (a K2.6-rank call's prompts
and recording): ``--same-path FROM=TO`` reads FROM as TO in every run's settings, flags and
environment before they are compared, and the merged report says so; the greedy prompts (the
dataset's first prompts, token ids) must still be equal. The merged report keeps the first run's
stamp (its device) and lists every run it was made of. Given one run, it rebuilds that run's
report with today's checks (the measurements as they were).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
from pathlib import Path

from . import render
from . import report as ab_report
from .arms import Arm
from .index import write_index

SAME = (
    "model",
    "drafter",
    "dataset",
    "dataset_path",
    "input_len",
    "output_len",
    "range_ratio",
    "seed",
    "check_prompts",
)


def equate_paths(report: dict, same_paths: list[tuple[str, str]]) -> dict:
    """``report`` with every FROM read as TO in its settings and its arms' flags and environment."""

    def rewrite(value):
        if isinstance(value, str):
            for old, new in same_paths:
                value = value.replace(old, new)
            return value
        if isinstance(value, list):
            return [rewrite(v) for v in value]
        if isinstance(value, dict):
            return {k: rewrite(v) for k, v in value.items()}
        return value

    arms = [{**a, "server_args": rewrite(a["server_args"]), "env": rewrite(a["env"])} for a in report["arms"]]
    return {**report, "settings": rewrite(report["settings"]), "arms": arms}


def same_path(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep or not old or not new:
        raise argparse.ArgumentTypeError(f"--same-path wants FROM=TO, got {text!r}")
    return old, new


def arm_from_json(data: dict) -> Arm:
    return Arm(
        name=data["name"],
        kind=data["kind"],
        description=data["description"],
        server_args=list(data["server_args"]),
        env=dict(data["env"]),
        base=data.get("base") or data["name"],
        variant=data.get("variant"),
        servers=[],
        runs=[],
        error=data.get("error"),
    )


def merge(reports: list[dict]) -> tuple[list[Arm], dict, list[str]]:
    """The arms of every run, their starts renumbered call after call; the merged settings; and
    the problems that forbid the merge (empty when it may go on)."""
    first = reports[0]["settings"]
    problems = []
    for r in reports[1:]:
        s = r["settings"]
        for key in SAME:
            if s.get(key) != first.get(key):
                problems.append(f"{r.get('series')}: {key} {s.get(key)!r} differs from {first.get(key)!r}")
        if dict(zip(s["concurrency"], s["num_prompts"])) != dict(
            zip(first["concurrency"], first["num_prompts"])
        ):
            problems.append(f"{r.get('series')}: other levels or prompts per level")
    arms: dict[str, Arm] = {}
    offset = 0
    for r in reports:
        starts = 0
        for data in r["arms"]:
            arm = arms.setdefault(data["name"], arm_from_json(data))
            if (arm.server_args, arm.env) != (data["server_args"], data["env"]):
                problems.append(f"{data['name']}: other flags or environment in {r.get('series')}")
            for server in data["servers"]:
                arm.servers.append({**server, "start": server["start"] + offset, "run": r.get("series")})
                starts = max(starts, server["start"] + 1)
            for run in data["runs"]:
                arm.runs.append({**run, "start": run["start"] + offset})
            for profile in data.get("profiles") or []:
                arm.profiles.append({**profile, "start": profile.get("start", 0) + offset})
        offset += starts
    names = list(dict.fromkeys(n for r in reports for n in r["settings"]["arms"]))
    settings = {
        **first,
        "arms": names,
        "schedule": "alternating" if len(reports) > 1 else first["schedule"],
        "schedule_reason": (
            f"{len(reports)} runs merged, each run's servers the next start of their arms "
            f"(the runs: {', '.join(r['settings']['schedule'] for r in reports)})"
            if len(reports) > 1
            else f"{first.get('schedule_reason')}; the report rebuilt from the run's JSON"
        ),
        "starts": offset,
        # a merged run names the runs it was merged from (a series rebuilt with a newer report
        # keeps the calls that made it)
        "merged_from": [
            entry for r in reports for entry in r["settings"].get("merged_from") or [_made_by(r)]
        ],
    }
    return [arms[n] for n in names if n in arms], settings, problems


def _made_by(report: dict) -> dict:
    stamp = report.get("stamp", {})
    return {
        "series": report.get("series"),
        "commit": stamp.get("commit"),
        "date": stamp.get("date_utc"),
        "command": stamp.get("command"),
        "status": report.get("status"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path, help="the runs' JSON files, in the order they ran")
    p.add_argument("--series", required=True, help="the merged series' name")
    p.add_argument("--results-dir", type=Path, default=Path("results"))
    p.add_argument("--no-index", action="store_true")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--same-path",
        type=same_path,
        action="append",
        default=[],
        metavar="FROM=TO",
        help="a path (or its start) that names in some runs what TO names in the others, e.g. each "
        "call's work folder (repeatable)",
    )
    args = p.parse_args(argv)
    reports = [equate_paths(json.loads(path.read_text()), args.same_path) for path in args.reports]
    arms, settings, problems = merge(reports)
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    settings["series"] = args.series
    if args.same_path:
        settings["same_paths"] = [f"{old}={new}" for old, new in args.same_path]
        settings["schedule_reason"] += "; paths read as the same: " + ", ".join(settings["same_paths"])
    statuses = [r["status"] for r in reports]
    status = next((s for s in ("failed", "interrupted") if s in statuses), "ok")
    errors = [f"{r.get('series')}: {r['error']}" for r in reports if r.get("error")]
    report = ab_report.build_report(
        arms=arms,
        settings=settings,
        status=status,
        error="\n".join(errors) or None,
        command=["python", "-m", "sglang_ddtree.ab.merge", *(argv if argv is not None else sys.argv[1:])],
        date=_dt.datetime.now(),
        allow_greedy_mismatch=bool(settings.get("allow_greedy_mismatch")),
        strict_parity=False,
        skipped=[s for r in reports for s in r.get("skipped", [])],
        dropped={k: v for r in reports for k, v in (r.get("dropped") or {}).items()},
        stamp=reports[0].get("stamp"),
    )
    report["stamp"]["command"] = shlex.join(report["command"])
    paths = render.write_report(report, args.results_dir, args.series, plot_png=not args.no_plot)
    if not args.no_index:
        paths.append(write_index(args.results_dir))
    print(render.console_summary(report))
    for path in paths:
        print(f"[ab] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
