"""lab.bench.step_split: a decode step's stages per arm and level, and two profiles' difference."""

import cProfile
import io
import marshal
import pstats
import tarfile
from datetime import datetime, timezone

from lab.bench.step_split import STEP_LINE, profile_diff, read_tarball, stage_table

T0 = datetime(2026, 12, 7, 19, 0, 0, tzinfo=timezone.utc).timestamp()


def _add(archive, name, data: bytes, mtime: float = T0):
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), mtime
    archive.addfile(info, io.BytesIO(data))


def _line(at: float, stages: dict) -> str:
    stamp = datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    return f"[{stamp}] STEP TIMER us/step: {stages}"


def test_a_timer_line_goes_to_the_pass_it_was_logged_in(tmp_path):
    # interleaved passes: a (c=1) ends at +10, b (c=1) at +20, a (c=8) at +30, b (c=8) at +40
    ends = [("a", 1, 10), ("b", 1, 20), ("a", 8, 30), ("b", 8, 40)]
    logs = {
        "a": [_line(T0 - 50, {"schedule": 999.0}), _line(T0 + 5, {"schedule": 100.0}),
              _line(T0 + 9, {"schedule": 300.0}), _line(T0 + 25, {"schedule": 50.0})],
        "b": [_line(T0 + 15, {"schedule": 200.0}), _line(T0 + 35, {"schedule": 70.0, "convert": 7.0})],
    }  # fmt: skip
    tarball = tmp_path / "x_logs.tar.xz"
    with tarfile.open(tarball, "w:xz") as archive:
        for arm, level, end in ends:
            _add(archive, f"raw/bench_{arm}_c{level}_r0.jsonl", b"{}", T0 + end)
        for arm, lines in logs.items():
            _add(archive, f"raw/server_{arm}.log", "\n".join(["noise", *lines]).encode())
    ends_read, lines, _ = read_tarball(str(tarball))
    table = stage_table(ends_read, lines, STEP_LINE)
    # a's c=1 median is of its two lines in that pass (the line before every pass, the greedy
    # check's, is left out); b's c=8 has a stage the others lack
    assert "| schedule | 200 | 200 | 50 | 70 |" in table
    assert "| convert |  |  |  | 7 |" in table
    assert table.splitlines()[0] == "| stage | a c=1 | b c=1 | a c=8 | b c=8 |"


def _profile(work) -> dict:
    profiler = cProfile.Profile()
    profiler.enable()
    work()
    profiler.disable()
    return marshal.loads(marshal.dumps(pstats.Stats(profiler).stats))


def forward_batch_generation():  # stands for the target worker's step, counted per launch
    pass


def test_the_profile_difference_is_per_decode_launch():
    def slow_extra():
        sum(range(20000))

    def first():
        for _ in range(4):
            forward_batch_generation()
            slow_extra()

    def second():
        for _ in range(4):
            forward_batch_generation()

    step = forward_batch_generation.__code__
    rename = {step.co_filename: "/x/managers/tp_worker.py"}

    def relabel(raw):
        return {(rename.get(f, f), line, fn): value for (f, line, fn), value in raw.items()}

    text = profile_diff(relabel(_profile(first)), relabel(_profile(second)))
    assert "(4 and 4 launches)" in text
    rows = [row for row in text.splitlines() if row.startswith("| +") or row.startswith("| -")]
    # the extra work's own time (in the builtin it calls) leads, at one call per launch
    assert "builtins.sum" in rows[0] and "| 1.00, 0.00 |" in rows[0]
    assert any("slow_extra" in row and "| 1.00, 0.00 |" in row for row in rows)
    assert profile_diff({}, relabel(_profile(second))) == "(a profile without decode launches)"
