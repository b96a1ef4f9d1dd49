"""The online budget's host-time benchmark on the CPU: it runs the served step loop, one
drafted step in PREDICT_EVERY makes the prediction, and the report says so."""

import torch

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
        "| budget | widths | bs | start (mean) | start | start (kept) | start (fold) |" in report
        and "log line (its summary), every row" in report
        and "steps back to back" in report
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


def test_served_rounds_spin_between_steps_and_are_left_out_of_the_times(tmp_path):
    """``--round-us``: every step spins its round (the loop takes at least that long a step), and
    none of it reaches the times reported; ``--jitter`` varies the rounds, and the report says both."""
    import json
    import time

    argv = ["--budgets", "7", "--batch-sizes", "1", "--steps", "40", "--warmup", "20", "--cpu"]
    began = time.perf_counter()
    assert (
        online_budget_host.main([*argv, "--round-us", "5000", "--jitter", "0.25", "--out", str(tmp_path)])
        == 0
    )
    assert time.perf_counter() - began > 60 * 5000e-6 * 0.7  # 60 steps of ~5 ms (lognormal factors)
    cell = json.loads((tmp_path / "online_budget_host_cpu.json").read_text())["cells"][0]
    assert cell["verify_clock_us"] < 500  # a tenth of the round is spun inside the verify clock
    assert cell["mean_us_per_step"] < 2500  # the spun rounds are not the budget's host work
    assert cell["start_us_mean"] > 0 and cell["finish_us_mean"] > 0
    report = (tmp_path / "online_budget_host_cpu.md").read_text()
    assert "each step spun 5000 us of round time" in report and "sigma 0.25" in report


def test_churn_changes_the_batch_size_as_load_does():
    """``--churn``: at that share of the steps the batch loses a request or gets it back (a
    prefill, an interrupt between the steps); without it every step runs the batch size asked."""
    from sglang_ddtree.adapter.widths import StepWidths

    seen = []
    start = StepWidths.start

    def recording(steps, bs):
        seen.append(bs)
        return start(steps, bs)

    StepWidths.start = recording
    try:
        steps = online_budget_host.served_steps(7)
        online_budget_host.run_steps(steps, 8, 200, torch.device("cpu"), churn=0.5)
        assert set(seen) == {7, 8} and 60 < sum(a != b for a, b in zip(seen, seen[1:])) < 140
        seen.clear()
        online_budget_host.run_steps(steps, 8, 50, torch.device("cpu"))
        assert set(seen) == {8}
    finally:
        StepWidths.start = start


def test_interleaved_runs_fold_into_one_series(tmp_path):
    """``gpu/jobs/budget_host_ab.sh``'s runs (NAME_before_N, NAME_after_N) become one series: a
    row per run and batch size in the order run, every report kept, the per-run files gone."""
    import json

    from lab.bench import online_budget_host_ab

    argv = ["--budgets", "7", "--batch-sizes", "1", "2", "--steps", "20", "--warmup", "10", "--cpu"]
    for name in ("x_before_1", "x_after_1", "x_before_2", "x_after_2"):
        assert online_budget_host.main([*argv, "--out", str(tmp_path), "--name", name]) == 0
    (tmp_path / "y_after_1.json").write_text("{}")  # another series' run: left alone
    (tmp_path / "x_z_after_1.json").write_text("{}")  # and one whose name starts with this one's
    assert (
        online_budget_host_ab.main([str(tmp_path), "x", "--before", "b0", "--after", "a1", "--command", "c"])
        == 0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "x.json",
        "x.md",
        "x_z_after_1.json",
        "y_after_1.json",
    ]
    data = json.loads((tmp_path / "x.json").read_text())
    assert list(data["runs"]) == ["before_1", "after_1", "before_2", "after_2"]
    rows = [
        line
        for line in (tmp_path / "x.md").read_text().splitlines()
        if line.startswith(("| before", "| after"))
    ]
    assert [row.split(" | ")[:3] for row in rows] == [
        ["| before", "1", "1"], ["| before", "1", "2"], ["| after", "1", "1"], ["| after", "1", "2"],
        ["| before", "2", "1"], ["| before", "2", "2"], ["| after", "2", "1"], ["| after", "2", "2"],
    ]  # fmt: skip


def test_the_cadences_asked_for_reach_the_served_steps(tmp_path):
    """``--predict-every``, ``--time-every``: the served loop predicts and times at the cadences
    asked (fewer predictions and fewer verify timings at longer ones), and the report says which."""
    import json

    from sglang_ddtree.budget import TimedCostTable

    def run(predict_every, time_every):
        steps = online_budget_host.served_steps(7, predict_every, time_every)
        online_budget_host.run_steps(steps, 1, 200, torch.device("cpu"))  # settles the row
        timed = online_budget_host._calls(steps._cost, "observe")
        before = timed[0]
        records = online_budget_host.run_steps(steps, 1, 400, torch.device("cpu"))
        return sum(r["predicted"] for r in records), timed[0] - before

    assert isinstance(online_budget_host.served_steps(7).cost, TimedCostTable)
    short, long = run(8, 2), run(64, 16)
    assert short[0] > 3 * long[0] and short[1] > 3 * long[1]
    argv = ["--budgets", "7", "--batch-sizes", "1", "--steps", "16", "--warmup", "8", "--cpu"]
    assert (
        online_budget_host.main(
            [*argv, "--predict-every", "64", "--time-every", "16", "--out", str(tmp_path)]
        )
        == 0
    )
    assert json.loads((tmp_path / "online_budget_host_cpu.json").read_text())["config"]["time_every"] == 16
    report = (tmp_path / "online_budget_host_cpu.md").read_text()
    assert "one drafted step in 64, a settled step's verify timed one in 16" in report
