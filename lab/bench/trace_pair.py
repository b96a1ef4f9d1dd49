"""Record a pair's real draws into a trace, then check that replaying the trace on the pair
itself gives back its served accept length (the trace replay's self-check).

1. **record**: one DDTREE server per arm (a budget, or ``chain``: budget block-1, one candidate
   per depth) with the real drafter and :mod:`.draw_recorder`; the prompts one at a time, greedy.
2. **trace**: the first arm's greedy output is the continuation (DDTREE's greedy output is the
   target's); every arm's rows are joined with it (:mod:`.draw_trace`), the union over arms
   (``--trace-arms``: only some, to measure what the replay does where the trace has no record).
3. **replay**: the same arms again, with the replay drafter on the trace (and the recorder, to
   see which roots each round had); same prompts.
4. **compare** per arm: tokens per round served vs replayed (``completion_tokens /
   spec_verify_ct`` summed over the prompts), the share of requests whose rounds rooted at the
   same positions (the same per-round accept lengths), identical outputs, and the replay's
   rounds by what the trace held at their offset (exact, shifted, past its end).

    [SGLANG_USE_CPU_ENGINE=1] python -m lab.bench.trace_pair --arms 7,16 --prompts 4 \\
        --output-len 32 --work /tmp/trace_pair --out /tmp/trace_pair

Each phase launches its arms' servers together (``--server-args``: the GPU flags; on the CPU
the float32 CPU defaults come first) and serves them one after the other. Writes
``<name>.{json,md}`` (default name ``<pair>_<device>_trace_selfcheck``), the trace in
``<work>/trace.json`` and a copy at ``--trace-out``; exits 1 where an arm is off by more than 2%.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from lab.bench import _stamp
from lab.bench.draw_recorder import ENV_DRAWS
from lab.bench.draw_trace import arm_sequences, build_trace, read_draws, write_json
from lab.bench.pair_eval import DEFAULT_PAIR, load_pair
from lab.bench.replay_drafter import ENV_TOKENS, ENV_TRACE
from sglang_ddtree.config import ENV_MAX_TOPK, ENV_TEST_PLUGIN, cpu_engine_requested
from sglang_ddtree.launch import ServerProcess, cpu_server_args

RECORDER, REPLAY = "lab.bench.draw_recorder", "lab.bench.replay_drafter"
CPU_ARGS = ["--dtype", "float32", "--log-level", "warning"]
TOLERANCE = 0.02  # replayed / served tokens per round


@dataclass(frozen=True)
class Arm:
    name: str
    budget: int
    chain: bool = False  # one candidate per depth (SGLANG_DDTREE_MAX_TOPK=1)


def parse_arms(text: str, block: int) -> list[Arm]:
    """``"chain,7,16"`` -> the chain (budget block-1, top-1) and DDTREE at each budget."""
    return [
        Arm("chain", block - 1, True) if a == "chain" else Arm(f"ddtree@{a}", int(a)) for a in text.split(",")
    ]


def server_args(pair: dict, arm: Arm, extra: list[str]) -> list[str]:
    spec = ["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(pair["drafter"])]
    spec += ["--speculative-ddtree-budget", str(arm.budget)]
    if cpu_engine_requested():
        return cpu_server_args(pair["target"], [*CPU_ARGS, *extra, *spec])
    return ["--model-path", str(pair["target"]), *extra, *spec]


def plugins(*names: str) -> str:
    """The test plugins a server loads: the caller's own (e.g. the GPU bundle's) first."""
    return ",".join(filter(None, [os.environ.get(ENV_TEST_PLUGIN), *names]))


def arm_env(arm: Arm, draws: Path, replay: dict[str, Path] | None) -> dict[str, str]:
    env = {ENV_DRAWS: str(draws), ENV_TEST_PLUGIN: plugins(RECORDER)}
    if replay:
        env |= {ENV_TEST_PLUGIN: plugins(REPLAY, RECORDER), ENV_TOKENS: str(replay["tokens"])}
        env[ENV_TRACE] = str(replay["trace"])
    if arm.chain:
        env[ENV_MAX_TOPK] = "1"
    return env


def serve(server: ServerProcess, prompts: list[list[int]], output_len: int) -> list[dict]:
    """Greedy, one prompt at a time: each request's sequence, tokens and rounds."""
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    results = []
    for prompt in prompts:
        out = server.generate({"input_ids": prompt, "sampling_params": params})
        meta = out["meta_info"]
        results.append(
            {
                "sequence": prompt + out["output_ids"],
                "tokens": meta["completion_tokens"],
                "rounds": meta["spec_verify_ct"],
            }
        )
    return results


def arm_server(pair, arm: Arm, folder: Path, extra, replay=None, timeout=900.0) -> ServerProcess:
    """An arm's server, not started: its draws go to ``folder/<arm>`` (emptied), its log beside."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder / arm.name, ignore_errors=True)
    env = arm_env(arm, folder / arm.name, replay)
    log = folder / f"{arm.name}.log"
    return ServerProcess(
        server_args(pair, arm, extra), env=env, log_path=log, name=arm.name, start_timeout=timeout
    )


def serve_arms(servers: dict[Arm, ServerProcess], prompts, output_len, folder: Path) -> dict[str, list[dict]]:
    """Each arm's server (launched ahead, or not yet) waited for, served and stopped in turn;
    what it emitted in ``folder/<arm>/sequences.json`` beside its draws."""
    results = {}
    try:
        for arm, server in servers.items():
            with server:
                results[arm.name] = serve(server, prompts, output_len)
            emitted = {"sequences": [r["sequence"] for r in results[arm.name]]}
            write_json(folder / arm.name / "sequences.json", emitted)
    finally:
        for server in servers.values():
            server.stop()
    return results


def write_trace(work: Path, arms: list[Arm], served: dict, topk: int, source: dict) -> dict:
    """The first served arm's outputs as the continuation (``work/continuation.json``) and the
    union trace of ``arms``' draws on it (``work/trace.json``)."""
    sequences = [r["sequence"] for r in next(iter(served.values()))]
    write_json(work / "continuation.json", {"sequences": sequences})
    recorded = [(read_draws(work / "record" / a.name), arm_sequences(work / "record" / a.name)) for a in arms]
    trace = build_trace(sequences, recorded, topk, source)
    write_json(work / "trace.json", trace)
    return trace


def launched(servers: dict) -> dict:
    """Launch every server at once (their starts overlap) and hand them back."""
    return {arm: server.launch() for arm, server in servers.items()}


# --------------------------------------------------------------------------- comparing


def trace_keys(trace: dict) -> dict[tuple[str, int], tuple[set, int]]:
    """Each trace request's identity -> its recorded offsets and continuation length."""
    return {(r["prompt"], r["prompt_len"]): (set(r["offsets"]), r["length"]) for r in trace["requests"]}


def roots_by_request(rows: list[dict], keys) -> dict[tuple[str, int], list[int]]:
    """Each request's round roots in order (its per-round accept lengths are their steps); only
    the requests of ``keys`` (a server's warm-up request is recorded too)."""
    roots: dict[tuple[str, int], list[int]] = {}
    for row in rows:
        key = (row["prompt"], row["prompt_len"])
        if key in keys:
            roots.setdefault(key, []).append(row["root_pos"])
    return {key: sorted(positions) for key, positions in roots.items()}


def trace_misses(rows: list[dict], keys) -> dict:
    """The replay's rounds by what the trace held at their offset (a self-replay: by prompt)."""
    counts = {"exact": 0, "shifted": 0, "past_end": 0}
    for row in rows:
        key = (row["prompt"], row["prompt_len"])
        if key in keys:
            offsets, length = keys[key]
            offset = row["root_pos"] - row["prompt_len"]
            counts["exact" if offset in offsets else "shifted" if offset < length else "past_end"] += 1
    return counts


def accept_length(results: list[dict]) -> float:
    return sum(r["tokens"] for r in results) / max(1, sum(r["rounds"] for r in results))


def compare(arm: str, served, replayed, served_rows, replayed_rows, trace) -> dict:
    keys = trace_keys(trace)
    served_roots, replayed_roots = roots_by_request(served_rows, keys), roots_by_request(replayed_rows, keys)
    same_rounds = sum(replayed_roots.get(key) == roots for key, roots in served_roots.items())
    a, b = accept_length(served), accept_length(replayed)
    return {
        "arm": arm,
        "served_tokens_per_round": round(a, 4),
        "replayed_tokens_per_round": round(b, 4),
        "ratio": round(b / a, 4),
        "requests": len(served),
        "same_rounds": same_rounds,
        "same_outputs": sum(x["sequence"] == y["sequence"] for x, y in zip(served, replayed)),
        "replay_rounds": trace_misses(replayed_rows, keys),
        "within_tolerance": abs(b / a - 1) <= TOLERANCE,
    }


def compare_arms(work: Path, arms: list[Arm], served: dict, replayed: dict, trace: dict) -> list[dict]:
    return [
        compare(
            a.name,
            served[a.name],
            replayed[a.name],
            read_draws(work / "record" / a.name),
            read_draws(work / "replay" / a.name),
            trace,
        )
        for a in arms
    ]


def self_check(
    pair, arms, prompts, output_len, work: Path, extra, topk=64, trace_out=None, traced=None
) -> dict:
    """Record, trace, replay, compare (the module docstring); the trace is ``work/trace.json``,
    copied to ``trace_out`` before the replay starts (a job cut short still has it). ``traced``:
    the arms whose draws make the trace (default: all; fewer measure the miss rule)."""
    record = launched({a: arm_server(pair, a, work / "record", extra) for a in arms})
    served = serve_arms(record, prompts, output_len, work / "record")
    traced = traced or arms
    source = {"pair": pair["name"], "arms": [a.name for a in traced], "output_len": output_len}
    trace = write_trace(work, traced, served, topk, source)
    if trace_out:
        write_json(trace_out, trace)
    replay = {"tokens": work / "continuation.json", "trace": work / "trace.json"}
    servers = launched({a: arm_server(pair, a, work / "replay", extra, replay) for a in arms})
    replayed = serve_arms(servers, prompts, output_len, work / "replay")
    rows = compare_arms(work, arms, served, replayed, trace)
    return {"rows": rows, "trace_arms": source["arms"], "trace_summary": trace["summary"]}


# --------------------------------------------------------------------------- report


def markdown(data: dict) -> str:
    rows = [
        [
            r["arm"],
            r["served_tokens_per_round"],
            r["replayed_tokens_per_round"],
            r["ratio"],
            f"{r['same_rounds']}/{r['requests']}",
            f"{r['same_outputs']}/{r['requests']}",
            "{exact}/{shifted}/{past_end}".format(**r["replay_rounds"]),
        ]
        for r in data["rows"]
    ]
    summary = data["trace_summary"]
    lines = [
        f"# Trace replay self-check: `{data['pair']}`",
        "",
        f"{data['prompts']} held-out prompts, {data['output_len']} greedy tokens, one at a time. Each arm "
        "served with the real drafter (recording its draws), then with the replay drafter on the "
        f"union trace of {', '.join(data['trace_arms'])}. Tolerance: replayed / served tokens per round "
        f"within {TOLERANCE:.0%}.",
        "",
        _stamp.stamp_markdown(data["stamp"]),
        "",
        _stamp.md_table(
            [
                "arm",
                "served tok/round",
                "replayed",
                "ratio",
                "same rounds",
                "same outputs",
                "replay rounds exact/shifted/past the end",
            ],
            rows,
        ),
        "",
        f"Trace: {summary['records']} records from {summary['rows']} rows ({summary['off_continuation']} off the "
        f"continuation, {summary['past_end']} past its end); top-1 share per depth {summary['top1_share']}, in the top-k {summary['in_topk_share']}.",
        "",
        f"Server arguments: `{shlex.join(data['server_args'])}`",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", type=Path, default=DEFAULT_PAIR)
    p.add_argument(
        "--drafter", default="drafter", help="the pair's drafter folder (e.g. one of train_drafter's)"
    )
    p.add_argument("--arms", default="chain,7,16,32,64", help="chain and/or DDTREE budgets")
    p.add_argument("--prompts", type=int, default=0, help="held-out prompts (0: all)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--topk", type=int, default=64, help="ranks the trace keeps per depth")
    p.add_argument("--trace-arms", default=None, help="the arms whose draws make the trace (default: all)")
    p.add_argument("--server-args", default="", help="flags every server gets (GPU: dtype, backends, memory)")
    p.add_argument("--work", type=Path, default=Path("/tmp/trace_pair"))
    p.add_argument("--trace-out", type=Path, default=None, help="a copy of the trace (.json or .json.gz)")
    p.add_argument("--out", type=Path, default=None, help="report folder (default: results)")
    p.add_argument("--name", default=None, help="report name (default: <pair>_<device>_trace_selfcheck)")
    args = p.parse_args(argv)
    pair = load_pair(args.pair, args.drafter)
    prompts = [q["input_ids"] for q in pair["prompts"][: args.prompts or None]]
    extra = shlex.split(args.server_args)
    arms = parse_arms(args.arms, pair["block"])
    data = {
        "pair": pair["name"],
        "prompts": len(prompts),
        "output_len": args.output_len,
        "server_args": extra,
    }
    traced = [a for a in arms if a in parse_arms(args.trace_arms, pair["block"])] if args.trace_arms else None
    data |= self_check(
        pair, arms, prompts, args.output_len, args.work, extra, args.topk, args.trace_out, traced
    )
    data["stamp"] = _stamp.stamp()
    name = args.name or f"{pair['name']}_{_stamp.device_slug(data['stamp'])}_trace_selfcheck"
    paths = _stamp.write_outputs(_stamp.results_dir(args.out), name, data, markdown(data))
    print(markdown(data))
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0 if all(r["within_tolerance"] for r in data["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
