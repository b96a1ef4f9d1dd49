"""Round cost and throughput of DDTREE against stock DFLASH and plain decoding, served.

    python -m lab.bench.gpu_rounds --out results --label pycode-4l-h200

Every arm is a real SGLang server on the same target, drafter and flags (only the
speculative flags differ). The servers start together (start-up is mostly compilation);
then each arm is measured alone in turn - the others are idle, their schedulers polling
on the host only. Per arm and concurrency: a warm-up pass of the same batch shape (so no
graph capture or JIT compile lands in a measurement), then ``--repeats`` timed passes of
``max(prompts-per-level, 2 x concurrency)`` greedy requests of ``--output-len`` tokens:

* tok/s - output tokens over wall time;
* accept length - output tokens per verify round (``spec_verify_ct`` of every request);
* round time - wall time per verify round of one request in flight: at concurrency 1,
  wall / rounds; above it, wall x concurrency / rounds (a batch advances all its requests
  in one round);
* TTFT and ITL - the median request's time to its first token, and the decode time per output
  token after it (each request's latency less its TTFT): where a level's wall time goes,
  request starts (prefills, and the rounds waiting on them) or the decode's pace;
* a torch-profiler trace of ``--profile-steps`` decode steps at the profiled batch sizes
  (SGLang's ``/start_profile``), summarised by :mod:`.round_profile`.

With ``--tp N`` every server runs ``--tp-size N`` (each on its own NCCL port from
``--nccl-port-base``); the profile is rank 0's, and its ``all-reduce`` category is the GPU
time of the tensor-parallel all-reduces per round.

Writes ``<label>.json``, ``.md`` and a ``.png`` (tok/s per concurrency; round time).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import json
import statistics
import tempfile
import time
import urllib.error
from pathlib import Path

from lab.bench import _stamp
from lab.bench.gpu_rounds_profile import (
    inter_token_ms,
    request_tokens,
    run_profiles,
    run_stack_profile,
    time_left,
)
from lab.bench.gpu_rounds_report import auto_budget
from lab.bench.output_lens import add_arguments as add_output_len_arguments
from lab.bench.output_lens import output_lens
from lab.bench.server_log import WIDTH_LOG_STEPS, online_budget_lines, steps_between, width_summary
from sglang_ddtree.budget import candidate_widths
from sglang_ddtree.config import ENV_ONLINE_BUDGET_LOG_EVERY
from sglang_ddtree.launch import ServerProcess, ServerStartError

PAIR = Path(__file__).resolve().parents[1] / "models" / "pairs" / "pycode-4l"
COMMON = [
    "--attention-backend", "triton",
    "--sampling-backend", "pytorch",
    "--dtype", "bfloat16",
    "--max-total-tokens", "131072",
    "--mem-fraction-static", "0.08",
    "--max-running-requests", "64",
    # info: the online budget's width line (every 1000 steps) reaches the log; the same in
    # every arm, so that SGLang's own periodic lines cost all of them alike.
    "--log-level", "info",
    # Every arm's server stays up through the run: idle schedulers that poll would take
    # the CPU the measured server's host work needs.
    "--sleep-on-idle",
    # Each request's TTFT in its meta_info (first_token_latency): a level's request starts
    # and its decode pace apart, in every arm alike.
    "--enable-metrics",
]  # fmt: skip


def parallel_args(tp: int, nccl_port: int | None) -> list[str]:
    """``--tp-size`` above 1, with this server's own NCCL rendezvous port: servers that
    start together would otherwise draw theirs at random from one range."""
    if tp == 1:
        return []
    return ["--tp-size", str(tp)] + ([] if nccl_port is None else ["--nccl-port", str(nccl_port)])


# Arm suffixes: the same server with a debugging variable, beside the plain arm.
VARIANTS = {
    "+phases": "SGLANG_DDTREE_PHASE_TIMES",  # host time per round phase (value: --phase-times)
    "+eagerstep": "SGLANG_DDTREE_EAGER_TREE_STEP",  # the tree step outside the drafter's graph
    "+eagerkv": "SGLANG_DDTREE_EAGER_DRAFT_KV",  # the drafter KV append outside CUDA graphs
    # ddtree@autoB only: an injected cost table that makes every step width 1 (no drafter, the
    # root alone through the verify path): what the online budget's fallback to no speculation
    # costs against plain decoding.
    "+width1": "SGLANG_DDTREE_BUDGET_COST_TABLE",
    # ddtree@autoB only: every width costs the same, so every step runs the widest tree (the
    # most expected tokens): the online budget's own bookkeeping at the fixed arm's width.
    "+widest": "SGLANG_DDTREE_BUDGET_COST_TABLE",
    # ddtree@autoB only: the online budget's whole step (timed table, choice, probes, prediction)
    # with the widest tree run every step: its own work, apart from the widths it would choose.
    "+pinned": "SGLANG_DDTREE_ONLINE_BUDGET_PIN_WIDEST",
    # The same server started twice: how far two servers of one call differ on their own.
    "+again": None,
}


def split_variant(arm: str) -> tuple[str, str | None]:
    """``ddtree@7+phases`` -> (``ddtree@7``, ``+phases``)."""
    for suffix in VARIANTS:
        if arm.endswith(suffix):
            return arm.removesuffix(suffix), suffix
    return arm, None


def arm_env(arm: str, phase_times: int, work: Path | None = None) -> dict | None:
    base, suffix = split_variant(arm)
    if suffix is None:
        return None
    if suffix == "+again":
        return {}
    if suffix in ("+width1", "+widest"):
        table = injected_cost_table(base, suffix, work or Path(tempfile.gettempdir()))
        return {VARIANTS[suffix]: str(table)}
    if suffix == "+pinned" and auto_budget(base) is None:
        raise ValueError(f"{arm}: the variant needs an online-budget arm (ddtree@autoB)")
    return {VARIANTS[suffix]: str(phase_times) if suffix == "+phases" else "1"}


def width_log_env(arm: str) -> dict:
    """An online-budget arm logs its widths every ``WIDTH_LOG_STEPS`` steps, so that each level
    reports the widths it chose (the difference of the lines around it)."""
    return {ENV_ONLINE_BUDGET_LOG_EVERY: str(WIDTH_LOG_STEPS)} if auto_budget(arm) is not None else {}


def injected_cost_table(arm: str, suffix: str, work: Path) -> Path:
    """A cost table (``$SGLANG_DDTREE_BUDGET_COST_TABLE``) for ``ddtree@autoB``: ``+width1``,
    width 1 far cheaper than any tree at every batch size (every step runs width 1);
    ``+widest``, every width the same cost (every step runs the widest tree)."""
    largest = auto_budget(arm)
    if largest is None:
        raise ValueError(f"{arm}{suffix}: the variant needs an online-budget arm (ddtree@autoB)")
    widths = candidate_widths(largest)
    batch_sizes = [1 << i for i in range(10)]
    path = work / f"{suffix.removeprefix('+')}_costs_{largest}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    row = [1.0 if w == 1 or suffix == "+widest" else 1e6 for w in widths]
    path.write_text(
        json.dumps({"batch_sizes": batch_sizes, "widths": list(widths), "ms": [row] * len(batch_sizes)})
    )
    return path


def arm_args(arm: str, drafter: str, graph_max_bs: int) -> list[str]:
    """``plain``, ``dflash``, ``ddtree@B`` or ``ddtree@auto`` / ``ddtree@autoB`` (the online
    budget, trees of at most ``B`` nodes, default 32; it logs its widths every 1000 steps),
    optionally with a :data:`VARIANTS` suffix -> server flags (``graph_max_bs`` 0: no graph flag)."""
    arm = split_variant(arm)[0]
    graphs = ["--cuda-graph-max-bs-decode", str(graph_max_bs)] if graph_max_bs else []
    if arm == "plain":
        return graphs
    spec = ["--speculative-draft-model-path", drafter]
    if arm == "dflash":
        return graphs + spec + ["--speculative-algorithm", "DFLASH"]
    name, _, budget = arm.partition("@")
    ddtree = graphs + spec + ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget"]
    largest = auto_budget(arm)
    if largest is not None:
        return ddtree + ["auto", "--speculative-num-draft-tokens", str(largest + 1)]
    if name != "ddtree" or not budget.isdigit():
        raise ValueError(f"unknown arm {arm!r}: expected plain, dflash, ddtree@BUDGET or ddtree@auto[BUDGET]")
    return ddtree + [budget]


def timed_pass(server: ServerProcess, prompts: list[list[int]], lens: list[int], concurrency: int) -> dict:
    """One pass of ``prompts`` (``lens``: each one's output length), ``concurrency`` in flight."""
    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda pl: request_tokens(server, *pl), zip(prompts, lens)))
    wall = time.perf_counter() - began
    tokens, rounds = sum(d["tokens"] for d in done), sum(d["rounds"] for d in done)
    ttfts = [d["ttft_s"] for d in done if d.get("ttft_s") is not None]
    return {
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "accept_length": tokens / rounds,
        "round_ms": 1e3 * wall * min(concurrency, len(prompts)) / rounds,
        "ttft_ms": 1e3 * statistics.median(ttfts) if ttfts else float("nan"),
        "itl_ms": inter_token_ms(done),  # the decode's pace, no request start in it
    }


def measure_level(servers: dict, prompts, args, concurrency: int) -> dict[str, dict]:
    """One concurrency level of every arm, interleaved: a warm-up pass per arm, then
    ``--repeats`` rounds in which every arm runs one timed pass (in a rotated order), so the
    arms' passes lie close in time and a slow spell of the host hits them alike; the median
    pass per arm, with every pass's tok/s kept to show the spread."""
    n = max(args.prompts_per_level, 2 * concurrency)
    batch = [prompts[i % len(prompts)] for i in range(n)]
    lens = output_lens(n, args.output_len, args.output_len_spread, seed=concurrency)  # same in every arm
    arms = list(servers)
    widths_before = {arm: width_summary(servers[arm].log_path) for arm in arms}  # None: no online budget
    for arm in arms:
        timed_pass(servers[arm], batch[:concurrency], lens[:concurrency], concurrency)  # same shapes
    passes: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(args.repeats):
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            passes[arm].append(timed_pass(servers[arm], batch, lens, concurrency))
    rows = {}
    for arm in arms:
        row = {k: statistics.median(p[k] for p in passes[arm]) for k in passes[arm][0]}
        row["tok_per_s_passes"] = [round(p["tok_per_s"], 1) for p in passes[arm]]
        phases = last_phase_times(servers[arm].log_path)  # None: not a +phases arm
        rows[arm] = {
            "concurrency": concurrency,
            "requests": n,
            **row,
            **({"phase_host_us": phases} if phases else {}),
        }
        if widths_before[arm] is not None:  # the widths of this level (its warm-up pass included)
            rows[arm]["width_steps_by_bs"] = steps_between(
                widths_before[arm], width_summary(servers[arm].log_path)
            )
    return rows


PHASE_LINE = "DDTREE phase host us/round:"


def last_phase_times(log_path: Path) -> dict | None:
    """The DDTREE server's latest host time per round phase (``SGLANG_DDTREE_PHASE_TIMES``):
    the last ``--phase-times`` rounds of the level just measured."""
    lines = [ln for ln in Path(log_path).read_text(errors="replace").splitlines() if PHASE_LINE in ln]
    return ast.literal_eval(lines[-1].split(PHASE_LINE, 1)[1].strip()) if lines else None


def run_levels(servers: dict, prompts, args, records: dict[str, dict]) -> None:
    """Every concurrency level, all arms interleaved within a level, while time is left
    (a level is skipped when less than its predecessor took remains)."""
    took = 0.0
    for concurrency in args.concurrency:
        if time_left(args) < took:
            for record in records.values():
                record["skipped"].append(f"c={concurrency}: deadline")
            continue
        began = time.monotonic()
        for arm, row in measure_level(servers, prompts, args, concurrency).items():
            records[arm]["levels"].append(row)
            print(f"[gpu_rounds] {arm} c={concurrency}: {row}", flush=True)
        took = time.monotonic() - began


def measure_all(live: dict, prompts, args, results: dict, save) -> None:
    """The levels (arms interleaved), then each profiled arm's profiles; saved as it goes."""
    records = {arm: {"arm": arm, "levels": [], "profiles": [], "skipped": []} for arm in live}
    results["arms"] = list(records.values())
    run_levels(live, prompts, args, records)
    save()
    trace_dir = Path(args.out) / f"{args.label}_work" / "traces"
    for arm in [a for a in live if a != "plain" and a in args.profile_arms]:
        run_profiles(live[arm], prompts, args, records[arm], trace_dir)
        save()
    for arm in [a for a in live if a in args.stack_profile_arms]:
        run_stack_profile(live[arm], prompts, args, records[arm], trace_dir)
        save()
    for arm, server in live.items():
        try:
            records[arm]["server_info_accept_length"] = server.accept_length()
        except (urllib.error.URLError, OSError):
            pass
        lines = online_budget_lines(server.log_path)
        if lines:
            records[arm]["online_budget_log"] = lines


def start_all(arms: list[str], args, log_dir: Path) -> tuple[dict[str, ServerProcess], dict[str, str]]:
    """Every arm's server, started together; returns them and the start-up error per failed arm."""
    ports = {
        arm: None if args.nccl_port_base is None else args.nccl_port_base + i for i, arm in enumerate(arms)
    }
    servers = {
        arm: ServerProcess(
            [
                "--model-path",
                args.model,
                *args.common,
                *arm_args(arm, args.drafter, args.graph_max_bs),
                *parallel_args(args.tp, ports[arm]),
            ],
            env={**(arm_env(arm, args.phase_times, log_dir) or {}), **width_log_env(arm)} or None,
            log_path=log_dir / f"{arm.replace('@', '_')}.log",
            start_timeout=args.start_timeout,
            name=arm,
        )
        for arm in arms
    }
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        errors = dict(zip(servers, pool.map(_start_or_error, servers.values())))
    return servers, {arm: e for arm, e in errors.items() if e is not None}


def _start_or_error(server: ServerProcess) -> str | None:
    """One arm that fails to start (e.g. out of memory beside the others) must not cost the
    others their measurement: its error is recorded instead."""
    try:
        server.start()
        return None
    except ServerStartError as error:
        server.stop()
        return str(error)[-1500:]


def _printable(args: dict) -> dict:
    return {k: sorted(v) if isinstance(v, set) else v for k, v in args.items() if k != "t0"}


def _wait_for(path: str | None) -> None:
    """Another GPU job may share the start-up; measure only once it is done."""
    while path and not Path(path).exists():
        time.sleep(1.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="plain,dflash,ddtree@7,ddtree@16,ddtree@32,ddtree@64")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--profile-bs", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--profile-export-s", type=float, default=180.0, help="wait this long for a trace file")
    p.add_argument("--profile-arms", default="dflash,ddtree@7,ddtree@32", help="arms that get a profile")
    p.add_argument(
        "--stack-profile-arms",
        default="",
        help="arms (plain included) that get one more profile, with Python stacks: host time by area",
    )
    p.add_argument("--stack-profile-bs", type=int, default=8, help="batch size of the stack profiles")
    p.add_argument(
        "--phase-times",
        type=int,
        default=50,
        help="arms named ddtree@B+phases log their host time per round phase every N rounds "
        "(the timer costs host time: compare with the untimed ddtree@B)",
    )
    p.add_argument("--deadline-s", type=float, default=1e9, help="skip what would end past this (from start)")
    p.add_argument(
        "--wait-file", default=None, help="start measuring once this file exists (servers start at once)"
    )
    p.add_argument("--model", default=str(PAIR / "target"))
    p.add_argument("--drafter", default=str(PAIR / "drafter"))
    p.add_argument("--prompts", default=str(PAIR / "heldout_prompts.json"))
    add_output_len_arguments(p, 128)
    p.add_argument("--prompts-per-level", type=int, default=8)
    p.add_argument("--repeats", type=int, default=4, help="timed passes per arm and level (interleaved)")
    p.add_argument("--graph-max-bs", type=int, default=32)
    p.add_argument("--start-timeout", type=float, default=420.0)
    p.add_argument("--common", default=" ".join(COMMON), help="flags of every arm (default: the GPU set)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every server (--tp-size)")
    p.add_argument(
        "--nccl-port-base",
        type=int,
        default=None,
        help="arm i rendezvous on this + i (default: SGLang picks)",
    )
    p.add_argument("--out", default="results")
    p.add_argument("--label", default="gpu_rounds")
    args = p.parse_args(argv)
    args.t0 = time.monotonic()
    args.common = args.common.split()
    args.profile_arms = set(args.profile_arms.split(","))
    args.stack_profile_arms = {a for a in args.stack_profile_arms.split(",") if a}

    out = Path(args.out)
    work = out / f"{args.label}_work"
    (work / "logs").mkdir(parents=True, exist_ok=True)
    prompts = [q["input_ids"] for q in json.loads(Path(args.prompts).read_text())]
    arms = [a for a in args.arms.split(",") if a]
    results = {
        "stamp": _stamp.stamp(),
        "args": _printable(vars(args)),
        "common_flags": args.common,
        "arms": [],
    }
    servers, failed = start_all(arms, args, work / "logs")
    try:
        for arm, error in failed.items():
            print(f"[gpu_rounds] {arm} did not start: {error}", flush=True)
        results["failed_to_start"] = failed
        if len(failed) == len(arms):
            return 2
        _wait_for(args.wait_file)
        live = {a: servers[a] for a in arms if a not in failed}
        measure_all(
            live, prompts, args, results, lambda: _stamp.write_json(out / f"{args.label}.json", results)
        )
    finally:
        for server in servers.values():
            server.stop()
    from lab.bench.gpu_rounds_report import write_report

    write_report(results, out, args.label)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
