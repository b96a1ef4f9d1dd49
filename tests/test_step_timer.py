"""The lab's step timer (``lab/bench/step_timer.py``): its count of host synchronisations per
decode step, by the source line that asked, fed the warnings PyTorch's sync debug mode gives on a
GPU (here written by hand: a CPU run has no device to wait for)."""

from __future__ import annotations

import logging

import pytest

from lab.bench import step_timer


@pytest.fixture()
def timer(monkeypatch):
    monkeypatch.setenv("SGLANG_STEP_TIMER_EVERY", "4")
    monkeypatch.setattr(step_timer, "_syncs", step_timer.Counter())
    monkeypatch.setattr(step_timer, "_totals", step_timer.defaultdict(float))
    monkeypatch.setattr(
        step_timer, "_state", {**step_timer._state, "decoding": False, "counting_syncs": True}
    )
    return step_timer


def test_syncs_of_decode_iterations_are_counted_per_source_line(timer, caplog):
    shown = []
    count = timer._count_sync(lambda *args: shown.append(args[0]))
    sync = f"UserWarning: {timer.SYNC_WARNING}"
    count(sync, UserWarning, "/x/prefill.py", 3)  # a prefill: not a decode step's
    timer._state["decoding"] = True
    for _ in range(4):
        count(sync, UserWarning, "/site/sglang_ddtree/adapter/decode_step.py", 61)
    for _ in range(2):
        count(sync, UserWarning, "/site/sglang/srt/managers/scheduler.py", 900)
    count("something else", UserWarning, "/x/y.py", 1)  # every other warning is shown as before
    assert shown == ["something else"]
    with caplog.at_level(logging.WARNING, logger="sglang_ddtree"):
        timer._log()
    (line,) = [r.getMessage() for r in caplog.records if timer.SYNC_LINE in r.getMessage()]
    assert line.endswith(
        "{'total': 1.5, 'sglang_ddtree/adapter/decode_step.py:61': 1.0, 'srt/managers/scheduler.py:900': 0.5}"
    ), line
    assert not timer._syncs  # the next period starts from zero


def test_a_period_without_syncs_says_zero(timer, caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_ddtree"):
        timer._log()
    assert any(r.getMessage().endswith(f"{timer.SYNC_LINE} {{'total': 0.0}}") for r in caplog.records)


def test_tensor_operations_are_counted_by_source_line_outside_the_graphed_forwards(timer, caplog):
    """``SGLANG_STEP_TIMER_OPS=1``: each operation a step dispatches, by the SGLang or plugin line
    that issued it; none inside a call a GPU runs in a CUDA graph, none outside a counted region."""
    import torch

    from sglang_ddtree.tree.batched import commit_sources

    timer._state.update(ops_mode=timer._OpSites(), graphed=0)
    counted = timer.Counter()
    path, accept_lens = torch.arange(12).view(3, 4), torch.tensor([1, 2, 3])
    commit_sources(path, accept_lens)  # not counted: outside
    with timer._counting_ops(counted):
        commit_sources(path, accept_lens)
        timer._graphed(commit_sources, path, accept_lens)  # a graph replay on a GPU: not counted
    commit_sources(path, accept_lens)
    assert counted and all(site.startswith("tree/batched.py:") for site in counted), counted
    assert all(site.endswith(" commit_sources") for site in counted)
    alone = timer.Counter()
    with timer._counting_ops(alone):
        commit_sources(path, accept_lens)
    assert alone == counted  # one call's operations, counted once
    timer._ops.update(alone)
    with caplog.at_level(logging.WARNING, logger="sglang_ddtree"):
        timer._log()
    (line,) = [r.getMessage() for r in caplog.records if timer.OPS_LINE in r.getMessage()]
    assert f"'total': {sum(alone.values()) / 4}" in line


def test_the_profile_of_decode_launches_is_written_at_every_log_line(timer, tmp_path):
    """``SGLANG_STEP_TIMER_PROFILE=<file>``: cProfile around each decode launch, its statistics
    written at every log line (what ran inside the launch, nothing outside it)."""
    import cProfile
    import pstats

    out = tmp_path / "launch.prof"
    timer._state.update(profile=cProfile.Profile(), profile_path=str(out), last_launch=None, steps=0)

    def inside_the_launch(scheduler, batch):
        return sum(range(100))

    def outside_the_launch():
        return sum(range(100))

    class Decode:
        forward_mode = type("Mode", (), {"is_decode": staticmethod(lambda: True)})()

    for _ in range(4):  # SGLANG_STEP_TIMER_EVERY=4: the fourth launch logs and writes the file
        timer._run_batch(inside_the_launch, None, Decode())
        outside_the_launch()
    names = {name for (_, _, name) in pstats.Stats(str(out)).stats}
    assert "inside_the_launch" in names and "outside_the_launch" not in names


def test_the_worker_s_forward_sampler_and_forward_batch_are_timed_inside_decode_launches_only(
    timer, monkeypatch, registered_hooks
):
    """``forward``, ``sample``, ``init_new``: the model runners' forwards, plain decoding's sampler
    and the forward batches made, timed inside a decode launch (a prefill's are not a step's);
    ``convert`` (a width-1 step made SGLang's own decode step) in the scheduling. The op counter's
    mode replaces the forward's timer with its own hook (SGLang runs one AROUND hook a target)."""
    monkeypatch.setenv("SGLANG_STEP_TIMER_SYNCS", "0")
    monkeypatch.delenv("SGLANG_STEP_TIMER_OPS", raising=False)
    timer.install()
    registered = dict(registered_hooks)
    runner = "sglang.srt.model_executor.model_runner.ModelRunner"
    forward, sample = registered[f"{runner}.forward"], registered[f"{runner}.sample"]
    init_new = registered["sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"]
    forward(lambda: None)  # outside a decode launch
    init_new(lambda: None)
    assert "forward" not in timer._totals and "init_new" not in timer._totals
    timer._state["in_decode_launch"] = True
    forward(lambda: None)
    sample(lambda: None)
    init_new(lambda: None)
    assert timer._totals["forward"] > 0 and timer._totals["sample"] > 0 and timer._totals["init_new"] > 0
    registered["sglang_ddtree.adapter.plain_steps.PlainSteps.convert"](lambda: None)  # in the scheduling
    assert timer._totals["convert"] > 0
    monkeypatch.setenv("SGLANG_STEP_TIMER_OPS", "1")
    timer.install()
    assert dict(registered_hooks)[f"{runner}.forward"] is timer._graphed  # the later hook replaces it
