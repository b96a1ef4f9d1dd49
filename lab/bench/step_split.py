"""Where a decode step's host time goes, per arm and level, from an A/B run's logs' tarball.

The timed arms of `gpu/jobs/ab_width1.sh` (`plain+timed`, `ddtree@auto64+timed`) log the
scheduler's stages every 64 decode steps (`STEP TIMER us/step`, `lab/bench/step_timer.py`) and
the DDTREE worker's phases (`DDTREE phase host us/round`); with `STEP_PROFILE=1` each also writes
a cProfile of its decode launches (`<series>_<arm>.pstats`). This prints:

* per timed arm and level, the median over its timer lines of each stage (us a step): a line is
  given to the pass it was logged in (between the end of the pass before it, of any arm, and the
  end of its own: the `bench_*` files' times);
* with `--profiles A B`: the functions whose own time (cProfile's `tottime`) differs most between
  the two profiles, per decode launch (each profile's calls of the target worker's
  `forward_batch_generation`). Profiled times are inflated by the profiler's own cost per call:
  read them as where, not how much.

    python -m lab.bench.step_split results/pycode-4l_h100_width1_stages_logs.tar.xz \
        --profiles ddtree-auto64-timed plain-timed
"""

from __future__ import annotations

import argparse
import ast
import io
import marshal
import re
import statistics
import tarfile
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import PurePosixPath

from lab.bench.itl_split import BENCH_FILE
from lab.bench.step_timer import LINE as STEP_LINE
from sglang_ddtree.ab.phase_log import PHASE_LINE

SERVER_LOG = re.compile(r"server_(?P<arm>.+)\.log$")
PROFILE_FILE = re.compile(r".+_(?P<arm>[^_]+)\.pstats$")
TIMER_LINE = re.compile(
    rf"^\[(?P<at>[\d-]+ [\d:]+)\] (?P<kind>{re.escape(STEP_LINE)}|{re.escape(PHASE_LINE)}) (?P<d>\{{.*\}})"
)
ADDRESS = re.compile(r" at 0x[0-9a-f]+")
STEP_FUNCTION = ("tp_worker.py", "forward_batch_generation")  # one call per decode launch


def read_tarball(path: str):
    """(the passes' ends [(time, arm, level)], the timed lines by arm [(time, kind, stages)],
    the profiles by arm {name: raw pstats dict})."""
    ends, lines, profiles = [], defaultdict(list), {}
    with tarfile.open(path) as archive:
        for member in archive.getmembers():
            if not member.isfile():
                continue
            name = PurePosixPath(member.name).name
            if match := BENCH_FILE.match(name):
                ends.append((float(member.mtime), match["arm"], int(match["c"])))
            elif match := SERVER_LOG.match(name):
                text = archive.extractfile(member).read().decode(errors="replace")
                lines[match["arm"]] = list(_timer_lines(text))
            elif match := PROFILE_FILE.match(name):
                profiles[match["arm"]] = marshal.load(io.BytesIO(archive.extractfile(member).read()))
    return sorted(ends), lines, profiles


def _timer_lines(text: str):
    for line in text.splitlines():
        match = TIMER_LINE.match(line)
        if match:
            at = datetime.strptime(match["at"], "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
            yield at.timestamp(), match["kind"], ast.literal_eval(match["d"])


def level_of(at: float, arm: str, ends: list, longest_pass_s: float = 30.0) -> int | None:
    """The level of the pass of ``arm`` a line logged at ``at`` belongs to: the pass whose
    window (from the end of the pass before it, of any arm, at most ``longest_pass_s`` before its
    own end) holds it, a second of slack each side (the logs' clock has seconds). None: outside
    the arm's passes (the greedy check, the servers' start)."""
    before = None
    for end, pass_arm, level in ends:
        start = end - longest_pass_s if before is None else max(before, end - longest_pass_s)
        if pass_arm == arm and start - 1 <= at <= end + 1:
            return level
        before = end
    return None


def stage_table(ends, lines, kind: str) -> str:
    """Markdown: stage x (arm, level) medians over the lines of ``kind``."""
    cells: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for arm, arm_lines in lines.items():
        for at, line_kind, stages in arm_lines:
            level = level_of(at, arm, ends) if line_kind == kind else None
            if level is not None:
                for stage, us in stages.items():
                    cells[arm, level][stage].append(us)
    if not cells:
        return ""
    columns = sorted(cells, key=lambda key: (key[1], key[0]))
    stages = list(dict.fromkeys(stage for column in columns for stage in cells[column]))
    head = "| stage | " + " | ".join(f"{arm} c={level}" for arm, level in columns) + " |"
    rows = [head, "|---" * (len(columns) + 1) + "|"]
    for stage in stages:
        values = [cells[column].get(stage) for column in columns]
        rows.append(
            f"| {stage} | " + " | ".join(f"{statistics.median(v):.0f}" if v else "" for v in values) + " |"
        )
    counts = [str(max((len(v) for v in cells[column].values()), default=0)) for column in columns]
    rows.append("| lines | " + " | ".join(counts) + " |")
    return "\n".join(rows)


def _by_function(raw: dict) -> dict[tuple[str, str], tuple[float, float]]:
    """(file tail, function) -> (calls, own seconds), summed over line numbers."""
    out: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for (filename, _line, function), (_cc, calls, own, _cum, _callers) in raw.items():
        tail = "/".join(PurePosixPath(filename).parts[-2:]) if filename != "~" else "builtins"
        cell = out[tail, ADDRESS.sub("", function)]  # a builtin's address differs per process
        cell[0] += calls
        cell[1] += own
    return {key: (calls, own) for key, (calls, own) in out.items()}


def _launches(functions: dict[tuple[str, str], tuple[float, float]]) -> float:
    """A profile's decode launches: its calls of the target worker's step."""
    file_tail, name = STEP_FUNCTION
    return sum(
        calls for (tail, fn), (calls, _) in functions.items() if tail.endswith(file_tail) and fn == name
    )


def profile_diff(first: dict, second: dict, top: int = 30) -> str:
    """Markdown: the functions whose own time per decode launch differs most (first - second)."""
    a, b = _by_function(first), _by_function(second)
    steps_a, steps_b = _launches(a), _launches(b)
    if not steps_a or not steps_b:
        return "(a profile without decode launches)"
    rows = []
    for key in set(a) | set(b):
        calls_a, own_a = a.get(key, (0, 0.0))
        calls_b, own_b = b.get(key, (0, 0.0))
        rows.append((own_a / steps_a - own_b / steps_b, calls_a / steps_a, calls_b / steps_b, key))
    rows.sort(key=lambda row: row[0], reverse=True)
    total_a = sum(own for _, own in a.values()) / steps_a
    total_b = sum(own for _, own in b.values()) / steps_b
    out = [
        f"Own time per decode launch (profiled): {total_a * 1e6:.0f} against {total_b * 1e6:.0f} us "
        f"({steps_a:.0f} and {steps_b:.0f} launches).",
        "",
        "| us / launch (first - second) | calls / launch (first, second) | function |",
        "|---|---|---|",
    ]
    for diff, calls_a, calls_b, (tail, fn) in rows[:top] + rows[-top // 3 :]:
        out.append(f"| {diff * 1e6:+.1f} | {calls_a:.2f}, {calls_b:.2f} | `{tail}:{fn}` |")
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tarball", help="an A/B series' logs (<series>_logs.tar.xz)")
    parser.add_argument(
        "--profiles",
        nargs=2,
        metavar=("FIRST", "SECOND"),
        help="two profiled arms (as in the file names) to compare",
    )
    args = parser.parse_args(argv)
    ends, lines, profiles = read_tarball(args.tarball)
    print("## The scheduler's stages (us a decode step, median over the timer lines)\n")
    print(stage_table(ends, lines, STEP_LINE) or "(no timer lines)")
    phases = stage_table(ends, lines, PHASE_LINE)
    if phases:
        print("\n## The DDTREE worker's phases (us a round)\n")
        print(phases)
    if args.profiles:
        first, second = args.profiles
        missing = [arm for arm in args.profiles if arm not in profiles]
        if missing:
            raise SystemExit(f"no profile of {missing} in the tarball (it has {sorted(profiles)})")
        print(f"\n## Own time, `{first}` against `{second}` (cProfile)\n")
        print(profile_diff(profiles[first], profiles[second]))


if __name__ == "__main__":
    main()
