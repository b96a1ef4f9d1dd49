"""Host time of the online budget's own work per decode step (``adapter/widths.py``).

Per step the worker calls ``StepWidths.start`` (the landed step folded into the cost table,
the probe check and the width choice) and ``StepWidths.finish`` (the step's record; one drafted
step in ``PREDICT_EVERY`` also makes the expected-accept prediction and starts its copy to the
host), and around the verify forward ``verify_started`` / ``verify_finished`` (the verify's
device time, two CUDA events). This times each on a timed cost table in its served state (every
cell priced), at the candidate widths of a few budgets (4 to 10 widths), for a few batch sizes.
A ``start`` that also folds a landed prediction into the calibration is timed apart. A
host-bound round pays this at every step (the trained pair on the H200 runs rounds of ~4.5 ms,
docs/online-budget.md).

``--round-us R --jitter S`` serves the loop as a server's rounds come: each step spins ``R``
microseconds of host time (a tenth of it between the verify clock's events, the rest after
``finish``: the verify and the rest of the round), each share times a lognormal factor of
sigma ``S``. The table then moves as a served one does (a median window that the rounds' noise
keeps shifting: kept choices re-made, probe checks re-run), which a loop with nothing in
between never shows; the spins are not counted in the times reported. ``--churn P`` changes the
batch's size as load does: at a share ``P`` of the steps a request ends (the size one less) or,
where one had, a prefill brings the batch back (an interrupt between the steps, as a prefill is);
with ``--wander`` the size walks between half the batch size and all of it, as a served batch's does.

``--cold`` also leaves the host's caches between steps as a served round's own host work does
(:class:`Evictor`): a server's ``start`` runs from cold caches, where it costs ten times what a
loop with warm caches reads, and what it costs there grows with every call and object it touches.

On a machine without a GPU the prediction's tensor operations run as CPU arithmetic, not as
kernel launches: the `finish` columns there are the host's Python and dispatch plus that
arithmetic, not what the same step costs beside a GPU. `start` is host work either way.

    python -m lab.bench.online_budget_host   # -> results/online_budget_host_<device>.{json,md}
    python -m lab.bench.online_budget_host --name online-budget_cpu_host_time  # the results series
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import statistics
import sys
import time

import numpy as np
import torch

from lab.bench import _stamp
from sglang_ddtree.adapter.widths import PREDICT_EVERY, TIME_EVERY, StepWidths
from sglang_ddtree.budget import TimedCostTable, candidate_widths

# SGLang's captured decode batch sizes up to 64 (the online budget's timed rows)
GRAPH_BATCH_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 40, 48, 56, 64)
DEPTH, TOP_K = 7, 64
CONFIDENT_LOGIT = 6.0  # over 63 standard-normal logits: the top token's share ~0.75


def served_steps(budget: int, predict_every: int = PREDICT_EVERY, time_every: int = TIME_EVERY) -> StepWidths:
    """A ``StepWidths`` whose timed table has a replay time for every cell (growing with the
    batch size and the width), as the start-up leaves it; ``predict_every``, ``time_every``: its
    cadences (the serving defaults, or others to weigh)."""
    widths = candidate_widths(budget)
    startup = [[0.3 + 0.004 * bs + 0.002 * w for w in widths] for bs in GRAPH_BATCH_SIZES]
    table = TimedCostTable(GRAPH_BATCH_SIZES, widths, startup)
    return StepWidths(
        widths,
        table,
        DEPTH,
        make_head=lambda width: width,
        predict_every=predict_every,
        time_every=time_every,
    )


def spin(us: float, caches: Evictor | None = None) -> None:
    """Host time passing as a round's would (busy: a sleep this short overshoots); with
    ``caches``, the round's own host work first leaves them as a served round does."""
    end = time.perf_counter() + us * 1e-6
    if caches is not None:
        caches.evict()
    while time.perf_counter() < end:
        pass


class Evictor:
    """A served round's host work, as the caches see it: the scheduler's and the forward's Python
    (thousands of calls over their own objects) and the kernels' launches leave the host's caches
    holding none of the online budget's code and data by the next step. A loop of steps with
    nothing between them runs every ``start`` from warm caches, ten times faster than a server
    does (``--cold``: ``start`` of a kept choice 2 us warm, ~20 us cold on this benchmark's CPU,
    where the CPU server's phases read 55 us). This reads ``mb`` megabytes (past the last-level
    cache) and walks ``objects`` Python objects."""

    def __init__(self, mb: int = 64, objects: int = 20000):
        self._bytes = np.ones(mb << 17)  # float64: 8 bytes each
        self._objects = [{"value": i} for i in range(objects)]

    def evict(self) -> None:
        self._bytes.sum()
        total = 0
        for entry in self._objects:
            total += entry["value"]


def run_steps(
    steps: StepWidths,
    bs: int,
    n: int,
    device: torch.device,
    round_us: float = 0.0,
    jitter: float = 0.0,
    churn: float = 0.0,
    cold: bool = False,
    wander: bool = False,
) -> list[dict]:
    """``n`` steps at batch size ``bs``: per step the host microseconds of ``start`` and
    ``finish`` and whether the step made the prediction; ``round_us``: the round's own time
    between them, spun; ``churn``: the share of steps whose batch is one request smaller or
    back to ``bs`` (module docstring), with ``wander`` a walk of the size between ``bs // 2`` and
    ``bs`` (each churning step ends a request, or one time in three a prefill brings one back:
    a served batch passes through every size of its range); ``cold``: each spin first evicts the caches (:class:`Evictor`)."""
    caches = Evictor() if cold and round_us else None
    noise, churner = random.Random(bs), random.Random(-bs)
    factor = (lambda: math.exp(noise.gauss(0.0, jitter))) if jitter else (lambda: 1.0)
    gen = torch.Generator(device=device).manual_seed(bs)
    # a confident drafter (its top token ~0.75 at every depth) and accept lengths like it: the
    # trees' expected tokens per round (~4.5) outweigh any host-time difference between a tree
    # step and a width-1 step, so the chooser serves trees (and predicts) however loaded the
    # host is. A drafter of uniform noise made trees and width 1 a coin flip on host time.
    logits = torch.randn(bs * DEPTH, TOP_K, generator=gen, device=device)
    logits[:, 0] += CONFIDENT_LOGIT
    log_probs = torch.log_softmax(logits, -1).sort(-1, descending=True).values
    accept_lens = torch.randint(DEPTH // 2, DEPTH + 1, (bs,), generator=gen, device=device)
    folds, choices, predictions = (
        _calls(steps.expected, "fold"),
        _calls(steps.chooser, "choose"),
        _calls(steps, "_predict"),
    )
    out, size = [], bs
    for _ in range(n):
        if churn and bs > 1 and churner.random() < churn:
            if wander:  # a request ended, or (one time in three) a prefill brought one back
                if size < bs and churner.random() < 1 / 3:
                    size += 1
                    steps.interrupt(joined=1)
                elif size > max(1, bs // 2):
                    size -= 1
            elif size < bs:  # a prefill brought the batch back
                size = bs
                steps.interrupt(joined=1)
            else:  # a request ended
                size = bs - 1
        folded, chosen, predicted = folds[0], choices[0], predictions[0]
        t0 = time.perf_counter()
        steps.start(size)
        t1 = time.perf_counter()
        if not steps.skips_draft:  # the drafter's proposals as the worker hands them over (``watch``)
            rows = log_probs[: size * DEPTH]
            steps.watch(lambda hidden, k, rows=rows: (rows, None))(None, TOP_K)
        t2 = time.perf_counter()
        steps.verify_started()  # the verify forward would run between these two
        verify_clock = time.perf_counter() - t2
        if round_us:
            spin(0.1 * round_us * factor(), caches)
        accepted = accept_lens[:size]  # (the worker hands ``finish`` its accept lengths as they are)
        t2 = time.perf_counter()
        steps.verify_finished()
        t3 = time.perf_counter()
        verify_clock += t3 - t2
        steps.finish(accepted)
        t4 = time.perf_counter()
        if round_us:
            spin(0.9 * round_us * factor(), caches)
        out.append(
            {
                "start_us": (t1 - t0) * 1e6,
                "verify_clock_us": verify_clock * 1e6,
                "finish_us": (t4 - t3) * 1e6,
                "predicted": predictions[0] > predicted,
                "folded": folds[0] > folded,  # a landed prediction went into the calibration
                "chose": choices[0] > chosen,  # the chooser was asked (not the kept choice)
            }
        )
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out


def _calls(owner, name: str) -> list[int]:
    """A counter of the calls of ``owner``'s method ``name`` (wrapped once)."""
    counters = owner.__dict__.setdefault("_bench_calls", {})
    if name not in counters:
        method, counter = getattr(owner, name), counters.setdefault(name, [0])

        def counted(*args):
            counter[0] += 1
            return method(*args)

        setattr(owner, name, counted)
    return counters[name]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(records: list[dict]) -> dict:
    predicting = [r["finish_us"] for r in records if r["predicted"]]
    recording = [r["finish_us"] for r in records if not r["predicted"]]
    return {
        "steps": len(records),
        "predicting_steps": len(predicting),
        "start_us": _median([r["start_us"] for r in records if not r["folded"]]),
        "start_us_kept": _median([r["start_us"] for r in records if not (r["folded"] or r["chose"])]),
        "start_us_folding": _median([r["start_us"] for r in records if r["folded"]]),
        "folding_steps": sum(r["folded"] for r in records),
        "chosen_steps": sum(r["chose"] for r in records),
        "verify_clock_us": statistics.median(r["verify_clock_us"] for r in records),
        "finish_us_recording": _median(recording),
        "finish_us_predicting": _median(predicting),
        "start_us_mean": statistics.fmean(r["start_us"] for r in records),
        "finish_us_mean": statistics.fmean(r["finish_us"] for r in records),
        "mean_us_per_step": statistics.fmean(
            r["start_us"] + r["verify_clock_us"] + r["finish_us"] for r in records
        ),
    }


def log_line_us(budget: int, device: torch.device, calls: int = 20) -> dict:
    """The median host time of the online budget's log line (``StepWidths.summary``) with every
    row of the table served, as a run through every batch size leaves it: the round benchmark's
    ``auto`` arms write it every 50 steps, a stats line every interval."""
    steps = served_steps(budget)
    for bs in GRAPH_BATCH_SIZES:
        run_steps(steps, bs, 30, device)
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        steps.summary()
        times.append((time.perf_counter() - began) * 1e6)
    return {"budget": budget, "rows": len(GRAPH_BATCH_SIZES), "us": statistics.median(times)}


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    results = {"stamp": _stamp.stamp(), "config": vars(args).copy(), "device": device.type, "cells": []}
    results["command"] = "python -m lab.bench.online_budget_host " + shlex.join(args.argv)
    results["log_line"] = [log_line_us(budget, device) for budget in args.budgets]
    for budget in args.budgets:
        for bs in args.batch_sizes:
            steps = served_steps(budget, args.predict_every, args.time_every)
            served = {
                "round_us": args.round_us,
                "jitter": args.jitter,
                "churn": args.churn,
                "cold": args.cold,
                "wander": args.wander,
            }
            run_steps(steps, bs, args.warmup, device, **served)  # prices the row's cells, fills the probes
            cell = summarise(run_steps(steps, bs, args.steps, device, **served))
            priced = steps.summary()["own_cost_widths_by_bs"].get(bs, [])  # bs: a row of the table
            cell.update(budget=budget, bs=bs, widths=len(steps.widths), priced_widths=len(priced))
            results["cells"].append(cell)
    return results


def to_markdown(results: dict) -> str:
    cfg = results["config"]
    rows = [
        [
            c["budget"],
            c["widths"],
            c["bs"],
            c.get("start_us_mean"),
            c["start_us"],
            c["start_us_kept"],
            c["start_us_folding"],
            c["verify_clock_us"],
            c["finish_us_recording"],
            c["finish_us_predicting"],
            c.get("finish_us_mean"),
            c["mean_us_per_step"],
            f"{c['chosen_steps']} / {c['steps']}",
            f"{c['predicting_steps']} / {c['steps']}",
        ]
        for c in results["cells"]
    ]
    return "\n".join(
        [
            "# The online budget's host time per decode step",
            "",
            _stamp.stamp_markdown(results["stamp"]),
            "",
            f"command: `{results.get('command', 'python -m lab.bench.online_budget_host')}`",
            "",
            f"Tensors on `{results['device']}`; {_served(results['config'])}medians over "
            f"{results['config']['steps']} steps after {results['config']['warmup']} warm-up steps per "
            "cell (us), wall time, except the means (every step: what a round pays on average). `start`: the steps "
            "that fold no prediction; `start (kept)`: those of them that kept the last choice (the costs "
            "drifted less than could change it); `start (fold)`: the steps that also fold a landed "
            "prediction into the calibration (and so choose anew); `chosen anew`: the steps that asked "
            f"the chooser. The prediction is made on one drafted step in {cfg['predict_every']}, "
            f"a settled step's verify timed one in {cfg['time_every']}. On a CPU the "
            "prediction's tensor operations are CPU arithmetic, not kernel launches (the module docstring).",
            "",
            _stamp.md_table(
                [
                    "budget",
                    "widths",
                    "bs",
                    "start (mean)",
                    "start",
                    "start (kept)",
                    "start (fold)",
                    "verify clock",
                    "finish (record)",
                    "finish (predict)",
                    "finish (mean)",
                    "mean per step",
                    "chosen anew",
                    "predicting steps",
                ],
                rows,
            ),
            "",
            "The online budget's log line (its summary), every row of the table served: "
            + ", ".join(f"budget {c['budget']}: {c['us']:.0f} us" for c in results.get("log_line", []))
            + ".",
        ]
    )


def _served(config: dict) -> str:
    """How the loop served its steps (``--round-us``, ``--jitter``), for the report."""
    round_us = config.get("round_us") or 0.0
    if not round_us:
        return "steps back to back (no round between them: the table barely moves); "
    return (
        f"each step spun {round_us:g} us of round time (a tenth inside the verify clock), each share "
        f"times a lognormal factor of sigma {config.get('jitter') or 0.0:g}, not counted; "
        + (
            f"at {config['churn']:g} of the steps the batch lost a request or got it back"
            + (
                " (its size walking between half the batch size and all of it)"
                if config.get("wander")
                else ""
            )
            + "; "
            if config.get("churn")
            else ""
        )
        + (
            "each spin first evicted the host's caches (`Evictor`: a served round's host work); "
            if config.get("cold")
            else ""
        )
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[7, 15, 64, 256], help="4, 5, 8 and 10 widths")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=400)
    p.add_argument("--cpu", action="store_true", help="host tensors even where a GPU is present")
    p.add_argument(
        "--round-us", type=float, default=0.0, help="host time spun per step as a round's (0: none)"
    )
    p.add_argument("--jitter", type=float, default=0.0, help="lognormal sigma of each spun share (0: none)")
    p.add_argument(
        "--churn", type=float, default=0.0, help="share of steps whose batch loses a request or gets it back"
    )
    p.add_argument(
        "--wander",
        action="store_true",
        help="with --churn: the batch's size walks between half the batch size and all of it",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="each round's spin first evicts the host's caches, as a served round's host work does",
    )
    p.add_argument(
        "--predict-every",
        type=int,
        default=PREDICT_EVERY,
        help="drafted steps per prediction (the serving default)",
    )
    p.add_argument(
        "--time-every",
        type=int,
        default=TIME_EVERY,
        help="settled steps per timed verify (the serving default)",
    )
    p.add_argument("--out", default=None, help="results folder (default: results)")
    p.add_argument("--name", default=None, help="file name (default: online_budget_host_<device>)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    results = run(args)
    name = args.name or f"online_budget_host_{_stamp.device_slug(results['stamp'])}"
    for path in _stamp.write_outputs(_stamp.results_dir(args.out), name, results, to_markdown(results)):
        print(path)
    print(to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
