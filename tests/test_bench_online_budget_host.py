"""The online budget's host-time benchmark on the CPU: it runs the served step loop, one
drafted step in PREDICT_EVERY makes the prediction, and the report says so."""

from lab.bench import online_budget_host
from sglang_ddtree.adapter.widths import PREDICT_EVERY


def test_the_benchmark_times_start_and_finish_and_counts_the_predicting_steps(tmp_path):
    assert (
        online_budget_host.main(
            [
                "--budgets",
                "7",
                "--batch-sizes",
                "1",
                "8",
                "--steps",
                "64",
                "--warmup",
                "40",
                "--cpu",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    import json

    results = json.loads((tmp_path / "online_budget_host_cpu.json").read_text())
    assert [(c["budget"], c["bs"]) for c in results["cells"]] == [(7, 1), (7, 8)]
    for cell in results["cells"]:
        assert cell["steps"] == 64 and cell["start_us"] > 0 and cell["mean_us_per_step"] > 0
        assert cell["verify_clock_us"] > 0 and cell["priced_widths"] >= 1  # the served rounds priced the row
        # the benchmark's confident drafter makes the chooser serve trees, however loaded the host
        # (a width-1 probe may take a step); drafted steps predict one in PREDICT_EVERY
        assert 64 // PREDICT_EVERY - 1 <= cell["predicting_steps"] <= 64 // PREDICT_EVERY + 1
        assert cell["finish_us_predicting"] is not None and cell["finish_us_recording"] is not None
        # a start after a predicting step folds its prediction (timed apart); the others do not
        assert cell["folding_steps"] >= cell["predicting_steps"] - 1 and cell["start_us_folding"] > 0
        assert cell["folding_steps"] <= cell["chosen_steps"] < cell["steps"]  # a fold chooses anew
    assert [(c["budget"], c["rows"]) for c in results["log_line"]] == [(7, 24)]
    assert results["log_line"][0]["us"] > 0
    assert results["command"].startswith("python -m lab.bench.online_budget_host --budgets 7")
    report = (tmp_path / "online_budget_host_cpu.md").read_text()
    assert (
        "| budget | widths | bs | start | start (kept) | start (fold) |" in report
        and "log line (its summary), every row" in report
    )
    assert "command: `python -m lab.bench.online_budget_host --budgets 7" in report


def test_the_benchmark_writes_the_series_it_is_named(tmp_path):
    argv = ["--budgets", "7", "--batch-sizes", "1", "--steps", "16", "--warmup", "8", "--cpu"]
    assert (
        online_budget_host.main([*argv, "--out", str(tmp_path), "--name", "online-budget_cpu_host_time"]) == 0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "online-budget_cpu_host_time.json",
        "online-budget_cpu_host_time.md",
    ]
