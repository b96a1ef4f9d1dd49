"""A width-1 step of ``--speculative-ddtree-budget auto`` against a plain decode step, through
real CPU servers on the tiny models (issue 48; ``lab/notes/no-spec-step.md``).

Arms (one server each, all up at once, measured in turn):

* ``plain``: no speculation (overlap scheduler, float32, as the others);
* ``width1``: DDTREE ``auto`` (budget 16) with an injected cost table where width 1 wins at
  every batch size, so nearly every step runs width 1 without the drafter, and the phase
  timer on (``SGLANG_DDTREE_PHASE_TIMES``);
* ``width1@before`` (``--before DIR``): the same served from another copy of the package
  (e.g. ``git archive <commit> sglang_ddtree | tar -x -C DIR``): the step as it was.

Per batch size and repeat, every arm decodes one batch (one ``/generate`` call of ``bs``
prompts, greedy, ``ignore_eos``) twice, to ``--short`` and to ``--long`` new tokens; the
difference over the difference in tokens is the time of one decode step with the prefill
left out. The DDTREE arms' phase lines logged during the long runs (those without a drafter
forward) give the step's host time per phase; ``round`` is the worker's whole step and
``between rounds`` the host time from the end of one step to the start of the next (the
scheduler's share).

On a CPU the target's forward runs on the host inside the step (``decode forward``): these
numbers say what the step's own work costs beside a CPU forward of a tiny model, not what the
step costs beside an H200 (there the forward is asynchronous and the host work is the step).

    python -m lab.bench.width1_step --before /tmp/before   # -> results/tiny_cpu_width1_step.{json,md}
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lab.bench import _stamp
from lab.models.tiny import build_tiny_models
from sglang_ddtree.budget import candidate_widths
from sglang_ddtree.launch import ServerProcess, cpu_server_args

BUDGET = 16
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "for i in range(10):\n    print(i, i * i)\n",
    "Speculative decoding drafts tokens cheaply and verifies them.",
    "A draft tree holds many candidate continuations.",
    "Letters: a b c d e f g h i j k l m n o p.",
    "class Point:\n    x: int = 0\n",
]
PHASE_LINE = "DDTREE phase host us/round:"
STEP_LINE = "STEP TIMER us/step:"
OPS_LINE = "STEP TIMER ops/step:"
COMMON = ["--dtype", "float32", "--log-level", "warning"]


def width1_table(path: Path) -> Path:
    widths = list(candidate_widths(BUDGET))
    sizes = [1, 2, 4, 8, 16, 32, 64]
    ms = [[1.0 if w == 1 else 1e6 for w in widths] for _ in sizes]
    path.write_text(json.dumps({"batch_sizes": sizes, "widths": widths, "ms": ms}))
    return path


def servers(
    folder: Path, before: Path | None, phase_every: int, ops: bool = False, profile: bool = False
) -> dict[str, ServerProcess]:
    tiny = build_tiny_models()
    plain = cpu_server_args(tiny.target, COMMON)
    auto = cpu_server_args(
        tiny.target,
        [
            *COMMON,
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-draft-model-path",
            str(tiny.drafter),
            "--speculative-ddtree-budget",
            "auto",
            "--speculative-num-draft-tokens",
            str(BUDGET + 1),
        ],
    )
    here = str(Path(__file__).resolve().parents[2])
    timer = {  # the scheduler's stages per decode step (lab/bench/step_timer.py), in every arm
        "SGLANG_DDTREE_TEST_PLUGIN": "lab.bench.step_timer",
        "SGLANG_STEP_TIMER_EVERY": str(phase_every),
        "SGLANG_STEP_TIMER_OPS": "1" if ops else "0",
        "PYTHONPATH": here,
    }
    env = {
        **timer,
        "SGLANG_DDTREE_BUDGET_COST_TABLE": str(width1_table(folder / "width1_cost_table.json")),
        # the phase timer's own operations would be counted as the step's
        "SGLANG_DDTREE_PHASE_TIMES": "0" if ops else str(phase_every),
    }

    def profiled(env: dict, name: str) -> dict:  # cProfile of the decode launches (step_timer)
        return {**env, "SGLANG_STEP_TIMER_PROFILE": str(folder / f"{name}.prof")} if profile else env

    arms = {
        "plain": ServerProcess(
            plain,
            env=profiled(timer, "plain"),
            name="plain",
            log_path=folder / "plain.log",
            start_timeout=900,
        ),
        "width1": ServerProcess(
            auto,
            env=profiled(env, "width1"),
            name="width1",
            log_path=folder / "width1.log",
            start_timeout=900,
        ),
    }
    if before is not None:  # its package first, the lab's timer from here
        arms["width1@before"] = ServerProcess(
            auto,
            env={**env, "PYTHONPATH": os.pathsep.join([str(before), here])},
            name="width1-before",
            log_path=folder / "width1-before.log",
            start_timeout=900,
        )
    return arms


def decode(server: ServerProcess, bs: int, tokens: int) -> float:
    params = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    payload = {"text": [PROMPTS[i % len(PROMPTS)] for i in range(bs)], "sampling_params": params}
    start = time.perf_counter()
    out = server.generate(payload)
    took = time.perf_counter() - start
    assert all(len(o["output_ids"]) == tokens for o in out), "a request ended early"
    return took


def logged(log: Path, start: int, marker: str) -> list[dict]:
    """The dictionaries of the lines holding ``marker`` logged since byte ``start``."""
    text = log.read_bytes()[start:].decode(errors="replace")
    lines = [line for line in text.splitlines() if marker in line]
    return [ast.literal_eval(line.split(marker, 1)[1].strip()) for line in lines]


def phase_lines(log: Path, start: int) -> list[dict]:
    """The worker's phase lines logged since byte ``start``, of steps without a drafter forward."""
    return [p for p in logged(log, start, PHASE_LINE) if "draft forward" not in p]


def mean_phases(lines: list[dict]) -> dict[str, float]:
    keys = sorted({k for line in lines for k in line})
    return {k: round(statistics.fmean(line.get(k, 0.0) for line in lines), 1) for k in keys}


def measure(arms, batch_sizes, short: int, long: int, repeats: int) -> list[dict]:
    cells = []
    for bs in batch_sizes:
        for server in arms.values():
            decode(server, bs, short)  # warm-up at this batch size
        samples = {name: [] for name in arms}
        stages = {name: [] for name in arms}
        phases = {name: [] for name in arms}
        ops = {name: [] for name in arms}
        for repeat in range(repeats):
            order = list(arms)[repeat % len(arms) :] + list(arms)[: repeat % len(arms)]
            for name in order:
                server = arms[name]
                t_short = decode(server, bs, short)
                offset = server.log_path.stat().st_size
                t_long = decode(server, bs, long)
                samples[name].append(1e3 * (t_long - t_short) / (long - short))
                phases[name] += phase_lines(server.log_path, offset)
                stages[name] += logged(server.log_path, offset, STEP_LINE)
                ops[name] += logged(server.log_path, offset, OPS_LINE)
        for name in arms:
            cells.append(
                {
                    "arm": name,
                    "bs": bs,
                    "step_ms": round(statistics.median(samples[name]), 3),
                    "step_ms_samples": [round(s, 3) for s in samples[name]],
                    "phases_us": mean_phases(phases[name]) if phases[name] else None,
                    "phase_lines": len(phases[name]),
                    "scheduler_us": mean_phases(stages[name]) if stages[name] else None,
                    "scheduler_lines": len(stages[name]),
                    "ops_per_step": mean_phases(ops[name]) if ops[name] else None,
                    **_stamp.host_load(),
                }
            )
    return cells


def markdown(data: dict) -> str:
    cells = data["cells"]
    plain = {c["bs"]: c["step_ms"] for c in cells if c["arm"] == "plain"}
    rows = [
        [c["arm"], c["bs"], c["step_ms"], round(c["step_ms"] / plain[c["bs"]], 3), c["load_1m"]]
        for c in cells
    ]
    out = [
        "# A width-1 step against a plain decode step (tiny models, CPU servers)",
        "",
        _stamp.stamp_markdown(data["stamp"]),
        "",
        f"command: `{data.get('command', 'python -m lab.bench.width1_step')}`",
        "",
        f"Per cell: the median over {data['repeats']} repeats of (wall time to {data['long']} tokens - "
        f"to {data['short']}) / {data['long'] - data['short']}: one decode step of the whole server, "
        "prefill left out. On a CPU the target's forward is inside every step: the ratios do not "
        "predict an H200 (`lab/notes/no-spec-step.md`).",
        "",
        _stamp.md_table(["arm", "bs", "step ms", "/ plain", "load 1m"], rows),
        "",
        "Host time per decode step of the scheduler's stages (us, `lab/bench/step_timer.py`): "
        "`iteration` from one decode launch to the next; `run_batch` the launch, of which "
        "`worker` is the model worker's step (on a CPU with its forward), of which `forward` the model "
        "runners' forwards, `sample` plain decoding's sampler and `init_new` the forward batches made; "
        "in `schedule`, `check_decode_mem` SGLang's check that the step's KV fits and "
        "`schedule_decode` the DDTREE worker's width choice and, of it, `convert` a width-1 step's "
        "conversion into SGLang's own decode step:",
        "",
    ]
    staged = [c for c in cells if c["scheduler_us"]]
    stages = ["iteration", "schedule", "check_decode_mem", "prepare_for_decode", "schedule_decode", "convert"]
    stages += ["run_batch", "worker", "forward"]
    stages += ["sample", "init_new", "resolve_seq_lens"]
    stages += ["relay_payload", "copy_to_cpu"]
    out += [
        _stamp.md_table(
            ["stage", *(f"{c['arm']} bs {c['bs']}" for c in staged)],
            [[k, *(c["scheduler_us"].get(k, "") for c in staged)] for k in [*stages, "process_result"]],
        ),
        "",
        "Host time per phase of the DDTREE arms' width-1 steps (us, the mean of the phase lines "
        "without a drafter forward logged during the long runs):",
        "",
    ]
    phased = [c for c in cells if c["phases_us"]]
    keys = sorted(
        {k for c in phased for k in c["phases_us"]}, key=lambda k: (k in ("round", "between rounds"), k)
    )
    out.append(
        _stamp.md_table(
            ["phase", *(f"{c['arm']} bs {c['bs']}" for c in phased)],
            [[k, *(c["phases_us"].get(k, "") for c in phased)] for k in keys],
        )
    )
    counted = [c for c in cells if c.get("ops_per_step")]
    if counted:
        out += ["", *ops_tables(counted)]
    return "\n".join(out)


def ops_tables(cells: list[dict], sites: int = 12) -> list[str]:
    """Operations a decode step dispatches outside what a GPU graphs (``STEP TIMER ops/step``):
    the total per arm and batch size, then each arm's busiest source lines."""
    out = [
        "Tensor operations per decode step outside the CUDA-graphed forwards (`SGLANG_STEP_TIMER_OPS=1`, "
        "`lab/bench/step_timer.py`): on a GPU each is a launch or a host tensor operation of the step's "
        "own; the counter slows the step, so the times above are not this run's to quote. The `width1` "
        "arm's steps include its few drafting steps (refreshes: the drafter's and tree's operations, "
        "a fraction a step):",
        "",
        _stamp.md_table(
            ["arm", "bs", "ops / step"],
            [[c["arm"], c["bs"], c["ops_per_step"].get("total", 0)] for c in cells],
        ),
    ]
    for cell in cells:
        busiest = sorted(((n, k) for k, n in cell["ops_per_step"].items() if k != "total"), reverse=True)
        out += [
            "",
            f"`{cell['arm']}` at bs {cell['bs']}, the {sites} busiest sources:",
            "",
            _stamp.md_table(["source", "ops / step"], [[f"`{k}`", n] for n, k in busiest[:sites]]),
        ]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--phase-every", type=int, default=16, help="steps per phase line")
    parser.add_argument("--before", type=Path, help="a folder holding another sglang_ddtree package")
    parser.add_argument(
        "--ops",
        action="store_true",
        help="count the tensor operations per step instead of timing phases (slows the steps it counts)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the decode launches of each arm (<logs>/<arm>.prof; slows the steps it profiles)",
    )
    parser.add_argument("--out", type=Path, default=_stamp.REPO_ROOT / "results")
    parser.add_argument("--name", default="tiny_cpu_width1_step")
    args = parser.parse_args(argv)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folder = Path(tempfile.mkdtemp(prefix="width1-step-"))
    arms = servers(folder, args.before, args.phase_every, args.ops, args.profile)
    try:
        for server in arms.values():
            server.launch()
        for server in arms.values():
            server.wait_until_ready()
        cells = measure(arms, args.batch_sizes, args.short, args.long, args.repeats)
    finally:
        for server in arms.values():
            server.stop()
    data = {
        "stamp": _stamp.stamp(),
        "command": "python -m lab.bench.width1_step " + shlex.join(sys.argv[1:] if argv is None else argv),
        "repeats": args.repeats,
        "short": args.short,
        "long": args.long,
        "before": str(args.before) if args.before else None,
        "logs": str(folder),
        "cells": cells,
    }
    for path in _stamp.write_outputs(args.out, args.name, data, markdown(data)):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
