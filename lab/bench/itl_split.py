"""Split an A/B run's decode pace into the step and the stalls, from its logs' tarball.

The A/B tool judges arms by decode pace (1 / TPOT), which holds both a decode step's own time
and the waits of running requests behind other requests' prefills. For an arm that emits one
token a chunk (plain decoding, a width-1 step), `bench_serving`'s median inter-token latency is
one step; its mean and p99 hold the stalls, and the time to first token holds the prefill. This
prints, per arm and level, the median over the passes of each of those (ms), so a width-1 arm's
loss to plain can be read as step or stall (`lab/notes/2026-12-07.md`, "Fourteenth session").

    python -m lab.bench.itl_split results/pycode-4l_h100_width1_criteria_logs.tar.xz
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tarfile
from collections import defaultdict
from pathlib import PurePosixPath

FIELDS = ("median_itl_ms", "mean_itl_ms", "p99_itl_ms", "median_tpot_ms", "median_ttft_ms")
BENCH_FILE = re.compile(r"bench_(?P<arm>.+)_c(?P<c>\d+)_r(?P<rep>\d+)\.jsonl$")


def read_passes(tarball: str) -> dict[tuple[str, int], list[dict]]:
    """Every timed pass's summary (the last line of its `bench_*.jsonl`), by (arm, level)."""
    passes: dict[tuple[str, int], list[dict]] = defaultdict(list)
    with tarfile.open(tarball) as archive:
        for member in archive.getmembers():
            match = BENCH_FILE.match(PurePosixPath(member.name).name)
            if match is None or not member.isfile():
                continue
            lines = archive.extractfile(member).read().decode().strip().splitlines()
            if lines:
                passes[match["arm"], int(match["c"])].append(json.loads(lines[-1]))
    return passes


def split(passes: dict[tuple[str, int], list[dict]]) -> list[dict]:
    """One row per (arm, level): the median over its passes of each field."""
    rows = []
    for (arm, level), summaries in sorted(passes.items(), key=lambda item: (item[0][1], item[0][0])):
        row = {"arm": arm, "c": level, "passes": len(summaries)}
        for field in FIELDS:
            values = [s[field] for s in summaries if s.get(field) is not None]
            row[field] = statistics.median(values) if values else None
        rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    header = "| arm | c | passes | " + " | ".join(FIELDS) + " |"
    lines = [header, "|" + "---|" * (3 + len(FIELDS))]
    for row in rows:
        cells = ["-" if row[f] is None else f"{row[f]:.3f}" for f in FIELDS]
        lines.append(f"| {row['arm']} | {row['c']} | {row['passes']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tarball", help="an A/B series' _logs.tar.xz")
    print(render(split(read_passes(parser.parse_args(argv).tarball))))


if __name__ == "__main__":
    main()
