"""lab.bench.itl_split: the step and the stalls of an A/B run, read from its logs' tarball."""

import io
import json
import tarfile

from lab.bench.itl_split import read_passes, render, split


def _add(archive, name, text):
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def _summary(itl):
    return {
        "median_itl_ms": itl,
        "mean_itl_ms": itl + 1,
        "p99_itl_ms": 9.0,
        "median_tpot_ms": itl,
        "median_ttft_ms": 10.0,
    }


def test_each_arm_and_level_takes_the_median_of_its_passes_last_lines(tmp_path):
    tarball = tmp_path / "x_logs.tar.xz"
    with tarfile.open(tarball, "w:xz") as archive:
        for rep, itl in enumerate([1.0, 5.0, 2.0]):  # a first line the bench wrote before its summary
            _add(
                archive,
                f"raw/bench_ddtree-auto64-step1_c8_r{rep}.jsonl",
                json.dumps({"x": 0}) + "\n" + json.dumps(_summary(itl)),
            )
        _add(archive, "raw/bench_plain_c8_r0.jsonl", json.dumps(_summary(1.5)))
        _add(archive, "raw/bench_plain_c1_r0.jsonl", json.dumps(_summary(1.4)))
        _add(archive, "raw/server_plain.log", "not a pass")
    rows = split(read_passes(str(tarball)))
    assert [(r["arm"], r["c"], r["passes"]) for r in rows] == [
        ("plain", 1, 1),
        ("ddtree-auto64-step1", 8, 3),
        ("plain", 8, 1),
    ]
    assert rows[1]["median_itl_ms"] == 2.0 and rows[1]["mean_itl_ms"] == 3.0
    assert "| ddtree-auto64-step1 | 8 | 3 | 2.000 | 3.000 | 9.000 | 2.000 | 10.000 |" in render(rows)
