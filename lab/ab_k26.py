"""The A/B tool on one Kimi K2.6 TP-8 rank (``lab.models.k26_rank``): a preset of the engine.

    python -m lab.ab_k26 --model K/target --drafter K/drafter [--prompt-len 96]
        [--profile dflash-k25-code | --trace FILE] [--prompts 32] [--recording FILE] [A/B options]

The rank is served with ``--load-format dummy``: its drafter accepts nothing of its own, so
every speculative arm runs the replay drafter (``lab.bench.replay_drafter``, through the
test-plugin seam) on a recording of plain's greedy continuations, with the acceptance profile
``--profile`` (``lab.bench.replay_profiles``), or the real draws of a trace (``--trace``: a
drafter's recorded log-probs and true-token ranks, ``lab.bench.trace_replay``; the i-th prompt
plays the i-th trace request, cycling); greedy outputs stay the target's. The rank fills
the GPU, so the servers run one at a time: the alternating schedule, ``plain`` first (its
first server records the continuations the others replay, unless ``--recording`` names an
earlier call's), then every other arm, ``--starts`` times over.

Prompts: ``--prompts`` token-id prompts of ``--prompt-len`` tokens tiled from the trained
pair's held-out prompts (the rank's tokenizer is the pair's), each beginning with the
profile's own first token. The chain is DDTREE with one candidate per depth at the drafter's
block (stock DFLASH cannot take the replay drafter).

Every option after the preset's own goes to ``python -m sglang_ddtree.ab`` and overrides the
preset's defaults (:func:`ab_args`). The series is ``k26-rank_<device>_ab`` unless
``--label``/``--what``/``--series`` say otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import sys
from pathlib import Path

from lab.bench.replay_drafter import ENV_PROFILE, ENV_TOKENS, ENV_TRACE, recorded_row
from sglang_ddtree.ab.arms import parse_arm_names, split_variant
from sglang_ddtree.ab.cli import main as ab_main
from sglang_ddtree.config import ENV_ONLINE_BUDGET_LOG_EVERY, ENV_TEST_PLUGIN

PAIR_PROMPTS = Path(__file__).resolve().parent / "models" / "pairs" / "pycode-4l" / "heldout_prompts.json"
REPLAY_PLUGIN = "lab.bench.replay_drafter"
PROFILES = ("dflash-k25-code", "pycode-4l-ranks")

# Every arm's server: the rank with dummy weights, bf16, triton attention and the pytorch
# sampler as the GPU bundle serves, CUDA graphs for decode up to bs 64 in every arm.
COMMON = [
    "--load-format", "dummy",
    "--attention-backend", "triton",
    "--sampling-backend", "pytorch",
    "--dtype", "bfloat16",
    "--max-running-requests", "64",
    "--cuda-graph-max-bs-decode", "64",
    "--chunked-prefill-size", "16384",
    # Prefill graphs are not what is compared, and their first capture at the rank's size
    # outlasts a short GPU job.
    "--disable-prefill-cuda-graph",
]  # fmt: skip

DEFAULTS = [
    "--arms", "plain,chain,ddtree@7,ddtree@16,ddtree@32,ddtree@auto7,chain+again",
    "--schedule", "alternating",
    "--starts", "2",
    "--prelaunch",  # each next 61-layer server's minute of start-up overlaps the passes before it
    "--repeats", "2",
    "--concurrency", "1,8,32,64",
    "--num-prompts", "16,32,64,128",
    "--output-len", "64",
    "--range-ratio", "0.5",
    "--check-prompts", "4",
    "--label", "k26-rank",
]  # fmt: skip


def prompt_ids(base: list[list[int]], length: int, profile_index: int, count: int) -> list[list[int]]:
    """``count`` prompts of ``length`` ids tiled from ``base``, each starting with the profile's
    own token (``profile_index + 1``), so that a recording holds each profile's prompts apart."""
    prompts = []
    for i in range(count):
        ids = [profile_index + 1]
        while len(ids) < length:
            ids += base[(i + len(ids)) % len(base)]
        prompts.append(ids[:length])
    return prompts


# An online-budget arm's widths per batch size, logged every this many steps: a call's passes
# run ~1,000 steps, under the server's default interval, and its choices are what a loss is read from.
ONLINE_BUDGET_LOG_EVERY = 100


def replay_env(recording: Path, profile: str, trace: Path | None = None, online: bool = False) -> str:
    """The environment a speculative arm's server gets (one ``--arm-env`` value); ``online``: an
    online-budget arm, which also logs its widths."""
    plugins = ",".join(filter(None, [os.environ.get(ENV_TEST_PLUGIN), REPLAY_PLUGIN]))
    env = [f"{ENV_TEST_PLUGIN}={plugins}", f"{ENV_TOKENS}={recording}", f"{ENV_PROFILE}={profile}"]
    env += [f"{ENV_TRACE}={trace}"] if trace else []
    env += [f"{ENV_ONLINE_BUDGET_LOG_EVERY}={ONLINE_BUDGET_LOG_EVERY}"] if online else []
    return shlex.join(env)


def ab_args(
    model: str,
    drafter: str,
    prompts_file: Path,
    recording: Path,
    profile: str,
    rest: list[str],
    memory: tuple[float, int] = (0.88, 200000),
    trace: Path | None = None,
) -> list[str]:
    """The engine's command line: the preset's defaults, then ``rest`` (later flags win), and the
    replay environment for every speculative arm of the arms finally asked for. ``memory``: each
    server's ``--mem-fraction-static`` and ``--max-total-tokens`` (a short rank beside other
    servers takes a small share); ``trace``: real draws in place of the profile."""
    fraction, tokens = memory
    server = [*COMMON, "--mem-fraction-static", str(fraction), "--max-total-tokens", str(tokens)]
    args = ["--model", model, "--drafter", drafter, "--server-args", shlex.join(server), *DEFAULTS]
    args += ["--dataset", "custom", "--dataset-path", str(prompts_file), *rest]
    speculative = [(n, budget) for n, kind, budget in parse_arm_names(final(args).arms) if kind != "plain"]
    online = {split_variant(n)[0]: isinstance(budget, str) for n, budget in speculative}  # "auto[N]"
    for base, is_online in online.items():
        args += ["--arm-env", f"{base}={replay_env(recording, profile, trace, is_online)}"]
    # ARM+heapq (the tool's variant) keeps its arm's replay: an arm's environment reaches its variants
    return args


def final(args: list[str]) -> argparse.Namespace:
    """The values of ``--arms`` and ``--output-len`` the engine will see (the last ones given)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--arms")
    parser.add_argument("--output-len", type=int)
    return parser.parse_known_args(args)[0]


def record_plain(server, prompts: list[list[int]], output_len: int, profile: str) -> dict:
    """Plain's greedy continuation of every prompt (16 in flight): what the replay drafter's
    acceptance follows."""
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}

    def one(prompt):
        return prompt + server.generate({"input_ids": prompt, "sampling_params": params})["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        sequences = list(pool.map(one, prompts))
    return {"sequences": sequences, "profiles": [profile] * len(sequences)}


def check_recording(recording: dict, prompts: list[list[int]], output_len: int) -> None:
    """An earlier call's recording must hold every prompt with ``output_len`` tokens after it."""
    for prompt in prompts:
        row = recorded_row(recording["sequences"], prompt)
        if row < 0 or len(recording["sequences"][row]) - len(prompt) < output_len:
            raise SystemExit(f"the recording has no continuation of {output_len} tokens for a prompt")


def check_trace(trace: dict, output_len: int) -> None:
    """A trace must hold ``output_len`` tokens of every request's continuation: past its end a
    request gets the dummy drafter's own proposals (nothing accepted)."""
    from lab.bench.draw_trace import FORMAT

    if trace.get("format") != FORMAT:
        raise SystemExit(f"--trace: not a {FORMAT} trace")
    if min(r["length"] for r in trace["requests"]) < output_len:
        raise SystemExit(f"--trace: a request's continuation is shorter than --output-len {output_len}")


def recorder(prompts: list[list[int]], output_len: int, profile: str, path: Path):
    """The engine's hook: plain's first server records, before any speculative server starts."""

    def on_server_ready(arm, server, record) -> None:
        if arm.name == "plain" and not path.exists():
            print(f"[ab_k26] recording plain's continuations of {len(prompts)} prompts", flush=True)
            path.write_text(json.dumps(record_plain(server, prompts, output_len, profile)))

    return on_server_ready


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    p.add_argument("--model", required=True, help="the rank's target folder (python -m lab.models.k26_rank)")
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument(
        "--profile", default=PROFILES[0], help=f"replay acceptance profile ({', '.join(PROFILES)})"
    )
    p.add_argument("--trace", type=Path, default=None, help="replay a trace of real draws, not the profile")
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts (cycled to each level's count)")
    p.add_argument("--recording", type=Path, default=None, help="plain's recording from an earlier call")
    p.add_argument("--mem-fraction-static", type=float, default=0.88, help="each server's share of the GPU")
    p.add_argument("--max-total-tokens", type=int, default=200000, help="each server's KV pool")
    p.add_argument("--work", type=Path, default=Path("/tmp/ab_k26"), help="prompts and recording go here")
    opts, rest = p.parse_known_args(argv)
    opts.work.mkdir(parents=True, exist_ok=True)
    base = [q["input_ids"] for q in json.loads(PAIR_PROMPTS.read_text())]
    prompts = prompt_ids(base, opts.prompt_len, PROFILES.index(opts.profile), opts.prompts)
    prompts_file = opts.work / f"prompts_{opts.prompt_len}_{opts.profile}.json"
    prompts_file.write_text(json.dumps([{"input_ids": q} for q in prompts]))
    recording = opts.work / "recording.json"
    memory = (opts.mem_fraction_static, opts.max_total_tokens)
    trace = opts.trace.resolve() if opts.trace else None
    args = ab_args(opts.model, opts.drafter, prompts_file, recording, opts.profile, rest, memory, trace)
    output_len = final(args).output_len
    if trace:
        from lab.bench.draw_trace import read_json

        check_trace(read_json(trace), output_len)
    if opts.recording:
        check_recording(json.loads(opts.recording.read_text()), prompts, output_len)
        recording.write_text(opts.recording.read_text())
    else:
        recording.unlink(missing_ok=True)  # this call's plain records afresh
        arms = [n for n, _, _ in parse_arm_names(final(args).arms)]
        if arms[0] != "plain" and "--dry-run" not in rest:
            raise SystemExit(
                "--arms must begin with plain (it records what the others replay), or pass --recording"
            )
    return ab_main(
        args,
        command=["python", "-m", "lab.ab_k26", *argv],
        on_server_ready=recorder(prompts, output_len, opts.profile, recording),
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
