"""A/B of one Kimi K2.6 TP-8 rank on one GPU: plain vs chain vs DDTREE, set acceptance.

    python -m lab.bench.k26_ab --model K/target --drafter K/drafter --out OUT \\
        --arms plain,chain,ddtree@32,ddtree@16,ddtree@64,ddtree@8 --deadline-s 500

The rank (:mod:`lab.models.k26_rank`) is served with ``--load-format dummy``; its
~80 GB leave room for one server at a time, so the arms run in turn (start, measure, stop),
in the order given, each within its share of the time left (``--deadline-s`` from the
start): the first arms are the ones that must finish. ``plain`` runs first and records each
prompt's greedy continuation; the speculative arms run the replay drafter
(:mod:`.replay_drafter`) on that recording, one prompt set per acceptance profile, so one
server measures every profile. ``chain`` is DDTREE with one candidate per depth (budget 7,
``--speculative-ddtree-max-topk 1``): the DFlash chain's verify width on the same drafter and
the same replay - stock DFLASH could not take the replay drafter. Per arm, prompt length,
profile and concurrency: tok/s, accept length, round time and, on one check pass, how many
greedy outputs equal the plain recording. Writes ``<label>.json``, ``.md`` and ``.png``.

Arms that run one after another are never measured at the same time, and two servers of one
call have differed by up to 1.34x on the same trees (:mod:`.k26_ab_same_trees`): name an arm
again with ``+again`` (``--arms plain,chain,ddtree@7,ddtree@7+again,chain+again``) to measure
that spread in the call itself; the report pairs the repeats with their arms.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from lab.bench import _stamp
from lab.bench.gpu_rounds import injected_cost_table
from lab.bench.gpu_rounds_profile import inter_token_ms, profile_or_error, profile_request_start
from lab.bench.k26_ab_report import write_report
from lab.bench.k26_ab_same_trees import AGAIN
from lab.bench.k26_arms import CHAIN_BUDGET
from lab.bench.k26_recording import load_recording, same_share
from lab.bench.output_lens import add_arguments as add_output_len_arguments
from lab.bench.output_lens import longest, output_lens
from lab.bench.server_log import (
    WIDTH_LOG_STEPS,
    online_budget_lines,
    prefill_batches,
    prefill_summary,
    steps_between,
    width_summary,
)
from sglang_ddtree.ab.arms import ABError, ddtree_flags, parse_arm_names
from sglang_ddtree.config import ENV_BUDGET_COST_TABLE, ENV_ONLINE_BUDGET_LOG_EVERY, ENV_VERIFY_ATTENTION
from sglang_ddtree.launch import ServerProcess, ServerStartError

PAIR_PROMPTS = Path(__file__).resolve().parents[1] / "models" / "pairs" / "pycode-4l" / "heldout_prompts.json"
COMMON = [
    "--load-format", "dummy",
    "--attention-backend", "triton",
    "--sampling-backend", "pytorch",
    "--dtype", "bfloat16",
    "--mem-fraction-static", "0.88",
    "--max-running-requests", "32",
    "--max-total-tokens", "200000",
    "--chunked-prefill-size", "16384",
    # Prefill graphs are not what is compared, and their first capture at this size outlasted
    # a 6-minute job on the H200 (the plain server was still at shape 1 of 58).
    "--disable-prefill-cuda-graph",
    # Info in every arm: the online budget logs its widths at info (read back into the report),
    # and SGLang's prefill lines say how each arm's requests were batched into prefills.
    "--log-level", "info",
    # Per-request timings in meta_info (first_token_latency: the TTFT column), in every arm.
    "--enable-metrics",
]  # fmt: skip
REPLAY_PLUGIN = "lab.bench.replay_drafter"
SGLANG_VERIFY = "+sglang-verify"  # arm suffix: the same arm on SGLang's own MLA verify kernel
# ddtree@autoB only: every step at width 1, no drafter (an injected cost table): what the online
# budget's fallback to no speculation costs against plain decoding at the rank's shapes.
WIDTH1 = "+width1"


def base_arm(arm: str, work: Path | None = None) -> tuple[str, dict]:
    """An arm name without its suffix, and the environment the suffix asks for."""
    if arm.endswith(SGLANG_VERIFY):
        return arm.removesuffix(SGLANG_VERIFY), {ENV_VERIFY_ATTENTION: "sglang"}
    if arm.endswith(AGAIN):  # the same arm in a server of its own: the call's A/A
        name = arm.removesuffix(AGAIN)
        if name == "plain":
            raise ValueError(f"arm {arm!r}: only a speculative arm repeats (plain records what they replay)")
        return name, {}
    if arm.endswith(WIDTH1):
        name = arm.removesuffix(WIDTH1)
        table = injected_cost_table(name, WIDTH1, work or Path(tempfile.gettempdir()))
        return name, {ENV_BUDGET_COST_TABLE: str(table)}
    return arm, {}


def arm_args(arm: str, drafter: str, graph_max_bs: int) -> list[str]:
    """``plain``, ``chain``, ``ddtree@B`` or ``ddtree@autoB`` (the online budget, trees of at
    most ``B`` nodes; the A/B tool's arm names, parsed by it) -> server flags (the same graphs in
    every arm)."""
    graphs = ["--cuda-graph-max-bs-decode", str(graph_max_bs)]
    try:
        ((_, kind, budget),) = parse_arm_names(arm)
    except (ABError, ValueError) as error:
        raise ValueError(
            f"unknown arm {arm!r}: expected plain, chain, ddtree@BUDGET or ddtree@autoBUDGET"
        ) from error
    if kind == "plain":
        return graphs
    if kind == "chain":
        return graphs + ddtree_flags(drafter, CHAIN_BUDGET) + ["--speculative-ddtree-max-topk", "1"]
    if budget is None or budget == "auto":  # the rank's arms name their largest tree
        raise ValueError(f"arm {arm!r}: name its budget (ddtree@BUDGET or ddtree@autoBUDGET)")
    return graphs + ddtree_flags(drafter, budget)


def prompt_sets(base: list[list[int]], lengths: list[int], profiles: list[str], count: int) -> dict:
    """``{(length, profile): [prompt ids]}``: the pair's prompts tiled to each length, one
    set per profile (a distinct first token, so the replay drafter tells them apart)."""
    sets = {}
    for length in lengths:
        for p, profile in enumerate(profiles):
            prompts = []
            for i in range(count):
                ids = [p + 1]
                while len(ids) < length:
                    ids += base[(i + len(ids)) % len(base)]
                prompts.append(ids[:length])
            sets[(length, profile)] = prompts
    return sets


def _generate(server: ServerProcess, prompt: list[int], output_len: int) -> dict:
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    began = time.perf_counter()
    result = server.generate({"input_ids": prompt, "sampling_params": params})
    latency_s = time.perf_counter() - began
    meta = result["meta_info"]
    return {
        "latency_s": latency_s,
        "output_ids": result["output_ids"],
        "tokens": meta["completion_tokens"],
        "rounds": meta.get("spec_verify_ct") or meta["completion_tokens"],
        "ttft_s": meta.get("first_token_latency"),  # with --enable-metrics
    }


def run_batch(server, prompts, output_len, concurrency: int) -> tuple[list[dict], float]:
    """``prompts`` with ``concurrency`` in flight; ``output_len``: one length, or one per prompt."""
    lens = output_len if isinstance(output_len, list) else [output_len] * len(prompts)
    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda pl: _generate(server, *pl), zip(prompts, lens)))
    return done, time.perf_counter() - began


# Output tokens per timed pass at the least (16 requests at the 64-token default: at c=1 a pass
# of 4 requests let one slow TTFT move the cell by ~10%); longer outputs need fewer requests.
MIN_TOKENS_PER_PASS = 1024


def requests_per_pass(concurrency: int, output_len: int) -> int:
    """At least two requests per slot and :data:`MIN_TOKENS_PER_PASS` output tokens."""
    return max(2 * concurrency, -(-MIN_TOKENS_PER_PASS // max(output_len, 1)))


def measure(server, prompts, output_len: int, concurrency: int, repeats: int, spread: float = 0.0) -> dict:
    batch = [prompts[i % len(prompts)] for i in range(requests_per_pass(concurrency, output_len))]
    lens = output_lens(len(batch), output_len, spread, seed=concurrency)  # the same in every arm
    run_batch(server, batch[:concurrency], lens[:concurrency], concurrency)  # warm-up: the same shapes
    rows = []
    for _ in range(repeats):
        done, wall = run_batch(server, batch, lens, concurrency)
        tokens, rounds = sum(d["tokens"] for d in done), sum(d["rounds"] for d in done)
        ttfts = [d["ttft_s"] for d in done if d.get("ttft_s") is not None]
        rows.append(
            {
                "ttft_ms": 1e3 * statistics.median(ttfts) if ttfts else float("nan"),
                "itl_ms": inter_token_ms(done),
                "tok_per_s": tokens / wall,
                "accept_length": tokens / rounds,
                "round_ms": 1e3 * wall * min(concurrency, len(batch)) / rounds,
                "tpot_ms": 1e3 * wall * min(concurrency, len(batch)) / tokens,
            }
        )
    passes = [r["tok_per_s"] for r in rows]
    return {
        "concurrency": concurrency,
        **{k: statistics.median(r[k] for r in rows) for k in rows[0]},
        "tok_per_s_spread": max(passes) / min(passes),  # fastest pass over the slowest
    }


def start(arm: str, args, env: dict | None, log_dir: Path) -> ServerProcess:
    name, arm_env = base_arm(arm, log_dir)
    flags = ["--model-path", args.model, *args.common, *arm_args(name, args.drafter, args.graph_max_bs)]
    server = ServerProcess(
        flags,
        env={**(env or {}), ENV_ONLINE_BUDGET_LOG_EVERY: str(WIDTH_LOG_STEPS), **arm_env},
        log_path=log_dir / f"{arm.replace('@', '_')}.log",
        start_timeout=args.start_timeout,
    )
    began = time.monotonic()
    server.start()
    server.start_s = time.monotonic() - began
    return server


def record_plain(server, sets: dict, output_len: int) -> dict:
    """Greedy continuations of every prompt (the replay drafter's truth, the exactness reference)."""
    sequences, profiles = [], []
    for (_, profile), prompts in sets.items():
        done, _ = run_batch(server, prompts, output_len, min(len(prompts), 16))
        sequences += [p + d["output_ids"] for p, d in zip(prompts, done)]
        profiles += [profile] * len(prompts)
    return {"sequences": sequences, "profiles": profiles}


def identical_share(server, prompts, recording: dict, output_len: int) -> float:
    """Share of greedy outputs (16 in flight) equal to the plain recording."""
    done, _ = run_batch(server, prompts, output_len, min(len(prompts), 16))
    return same_share([d["output_ids"] for d in done], prompts, recording["sequences"])


def run_arm(server, arm: str, sets: dict, recording: dict | None, args, deadline: float) -> dict:
    record = {"arm": arm, "start_s": round(server.start_s, 1), "cells": [], "skipped": []}
    if arm in args.start_profile_arms:
        run_start_profiles(server, arm, sets, args, record)
    if arm in args.torch_profile_arms:  # first: a few rounds each, and the arm's share ends in cells
        run_torch_profiles(server, arm, sets, args, record, deadline)
    keys = list(sets) if arm != "plain" else [k for k in sets if k[1] == args.profiles[0]]
    for key in keys:
        length, profile = key
        if recording is not None and time.monotonic() < deadline:
            share = identical_share(
                server, sets[key], recording, longest(args.output_len, args.output_len_spread)
            )
            record["cells"].append({"prompt_len": length, "profile": profile, "identical_share": share})
        for concurrency in args.concurrency:
            if time.monotonic() > deadline:
                record["skipped"].append(f"len={length} {profile} c={concurrency}")
                continue
            widths_before = width_summary(server.log_path)
            prefills_before = len(prefill_batches(server.log_path))
            row = measure(
                server, sets[key], args.output_len, concurrency, args.repeats, args.output_len_spread
            )
            row["prefills"] = prefill_summary(prefill_batches(server.log_path)[prefills_before:])
            row["host"] = _stamp.host_load()  # the host beside the cell (its prefills are host-bound)
            if widths_before is not None:  # the online budget: what it chose in this cell
                row["width_steps_by_bs"] = steps_between(widths_before, width_summary(server.log_path))
            record["cells"].append(
                {"prompt_len": length, "profile": None if arm == "plain" else profile, **row}
            )
            print(f"[k26_ab] {arm} len={length} {profile} {row}", flush=True)
    info = server.server_info()
    state = (info.get("internal_states") or [{}])[0]
    record["max_total_num_tokens"] = info.get("max_total_num_tokens") or state.get("max_total_num_tokens")
    record["memory_usage"] = state.get("memory_usage")
    widths = online_budget_lines(server.log_path)
    if widths:
        record["online_budget_log"] = widths
    return record


# Profiled requests per ``--start-profile-arms`` arm, after one unprofiled one (one-time work of
# a first request stays out of them).
START_PROFILE_REQUESTS = 2


def run_start_profiles(server, arm: str, sets: dict, args, record: dict) -> None:
    """Requests one at a time, from an idle server or beside ``--start-profile-load`` decoding
    requests, each under the torch profiler through its prefill and first rounds: where its time
    to first token goes."""
    prompts = sets[(min(args.prompt_lens), args.profiles[0])]
    trace_dir = Path(args.out) / f"{args.label}_work" / "traces"
    _generate(server, prompts[0], args.output_len)
    rest = prompts[1 + START_PROFILE_REQUESTS :]  # never a profiled prompt (its prefill would be cached)
    load = [rest[j % len(rest)] for j in range(args.start_profile_load)] if rest else []
    record["start_profiles"] = [
        profile_request_start(
            server,
            prompts[1 + i],
            trace_dir / f"{arm.replace('@', '_')}_start{i}",
            args.profile_export_s,
            load,
        )
        for i in range(START_PROFILE_REQUESTS)
    ]


def run_torch_profiles(server, arm: str, sets: dict, args, record: dict, deadline: float) -> None:
    """Per-round torch profiles of ``arm`` at the longest prompts (where the verify's
    attention reads the most): GPU time by kernel family, launches, synchronisations."""
    key = (max(args.prompt_lens), args.profiles[0])
    trace_dir = Path(args.out) / f"{args.label}_work" / "traces"
    record["profiles"] = []
    for bs in args.torch_profile_bs:
        if time.monotonic() > deadline:
            record["skipped"].append(f"profile bs={bs}: deadline")
            continue
        record["profiles"].append(
            profile_or_error(server, sets[key], args, arm, bs, trace_dir, args.torch_profile_stack)
        )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--arms", default="plain,chain,ddtree@32,ddtree@16,ddtree@64,ddtree@8")
    p.add_argument("--profiles", default="dflash-k25-code,pycode-4l-ranks")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 4, 16, 2])
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[96, 4096])
    p.add_argument("--prompts", type=int, default=32, help="prompts per (length, profile) set")
    add_output_len_arguments(p, 64)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--recording",
        help="plain's recording from an earlier call of the same model, prompts and output length "
        "(<label>_work/recording.json): the speculative arms replay it, and plain need not run first",
    )
    p.add_argument("--graph-max-bs", type=int, default=32)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--deadline-s", type=float, default=500.0, help="nothing starts past this (from start)")
    p.add_argument("--common", default=" ".join(COMMON))
    p.add_argument(
        "--common-extra",
        default="",
        help="comma list of server flags appended to --common (the later flag wins), e.g. "
        "--mem-fraction-static=0.12,--max-total-tokens=20000 for a short rank beside other servers",
    )
    p.add_argument("--out", default="results")
    p.add_argument("--label", default="k26_rank_ab")
    p.add_argument(
        "--torch-profile-arms", default="", help="comma list: arms profiled per round (torch profiler)"
    )
    p.add_argument(
        "--torch-profile-bs", type=int, nargs="+", default=[1, 8], help="batch sizes of those profiles"
    )
    p.add_argument(
        "--torch-profile-stack",
        action="store_true",
        help="record those profiles with Python stacks: host time by area and where the host waits",
    )
    p.add_argument(
        "--start-profile-arms",
        default="",
        help="comma list: arms whose request start (prefill and first rounds, from idle) is profiled",
    )
    p.add_argument(
        "--start-profile-load",
        type=int,
        default=0,
        help="requests decoding beside each profiled request start (0: from an idle server)",
    )
    p.add_argument("--profile-steps", type=int, default=10, help="decode steps per profile")
    p.add_argument("--profile-export-s", type=float, default=90.0, help="wait this long for a trace file")
    p.add_argument("--profile-output-len", type=int, default=512, help="tokens per profiled request")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = args.t0 = time.monotonic()
    args.torch_profile_arms = [arm for arm in args.torch_profile_arms.split(",") if arm]
    args.start_profile_arms = [arm for arm in args.start_profile_arms.split(",") if arm]
    args.common = args.common.split() + [flag for flag in args.common_extra.split(",") if flag]
    args.profiles = args.profiles.split(",")
    out = Path(args.out)
    work = out / f"{args.label}_work"
    work.mkdir(parents=True, exist_ok=True)
    base = [q["input_ids"] for q in json.loads(PAIR_PROMPTS.read_text())]
    sets = prompt_sets(base, args.prompt_lens, args.profiles, args.prompts)
    results = {"stamp": _stamp.stamp(), "args": vars(args), "arms": []}
    recording, recording_path = None, work / "recording.json"
    if args.recording:  # an earlier call's plain: the speculative arms need not wait for plain
        recording = load_recording(
            Path(args.recording), sets, longest(args.output_len, args.output_len_spread)
        )
        recording_path.write_text(json.dumps(recording))
    arms = [a for a in args.arms.split(",") if a]
    if len(set(arms)) != len(arms):
        raise ValueError(f"--arms lists an arm twice ({args.arms}): name a repeat ARM{AGAIN}")
    for arm in arms:  # a misspelt arm stops the call here, not after the servers before it
        arm_args(base_arm(arm, work)[0], args.drafter, args.graph_max_bs)
    for i, arm in enumerate(arms):
        left = args.deadline_s - (time.monotonic() - t0)
        if left < 60 or (arm != "plain" and recording is None):
            results["arms"].append({"arm": arm, "skipped": ["not started: deadline or no plain recording"]})
            write_results(results, out, args.label)
            continue
        env = None
        if arm != "plain":
            env = {
                # beside the modules the device command installs (lab.gpu_compat)
                "SGLANG_DDTREE_TEST_PLUGIN": ",".join(
                    filter(None, [os.environ.get("SGLANG_DDTREE_TEST_PLUGIN"), REPLAY_PLUGIN])
                ),
                "SGLANG_DDTREE_REPLAY_TOKENS": str(recording_path),
            }
        try:
            server = start(arm, args, env, work)
        except ServerStartError as error:
            results["arms"].append({"arm": arm, "error": str(error)[-2000:]})
            continue
        try:
            if arm == "plain":
                recording = record_plain(server, sets, longest(args.output_len, args.output_len_spread))
                recording_path.write_text(json.dumps(recording))
            deadline = time.monotonic() + (args.deadline_s - (time.monotonic() - t0)) / (len(arms) - i)
            results["arms"].append(
                run_arm(server, arm, sets, None if arm == "plain" else recording, args, deadline)
            )
        finally:
            server.stop()
        write_results(results, out, args.label)
    return 0


def write_results(results: dict, out: Path, label: str) -> None:
    """JSON and report after every arm, run or not: a job cut by its time limit still leaves a
    report of what it ran and of which arms never started."""
    _stamp.write_json(out / f"{label}.json", results)
    write_report(results, out, label)


if __name__ == "__main__":
    raise SystemExit(main())
