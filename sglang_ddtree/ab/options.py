"""The A/B tool's command line: every option, in the groups ``--help`` shows (``cli.py`` runs
what they ask)."""

from __future__ import annotations

import argparse

from .arms import CHECK_PROMPTS, DEFAULT_ARMS
from .greedy_check import BF16_MARGIN
from .profiling import DEFAULT_STEPS as DEFAULT_PROFILE_STEPS


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_serve_args(p)
    _add_schedule_args(p)
    _add_load_args(p)
    _add_profile_args(p)
    _add_check_args(p)
    _add_results_args(p)
    return p


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to serve")
    g.add_argument("--model", help="target model (folder or hub id)")
    g.add_argument("--drafter", help="DFlash drafter (folder or hub id), shared by every speculative arm")
    g.add_argument(
        "--cpu",
        action="store_true",
        help="serve on the CPU (SGLANG_USE_CPU_ENGINE=1; adds --device cpu --attention-backend "
        "torch_native --max-total-tokens 8192 --dtype float32) with small defaults for small models",
    )
    g.add_argument("--server-args", default="", help="extra flags for every arm's server (one string)")
    g.add_argument(
        "--arm-args",
        action="append",
        default=[],
        metavar="ARM='--flag ...'",
        help="extra flags for one arm only (repeatable), e.g. ddtree='--speculative-dflash-block-size 8'; "
        "an arm's flags also reach its variants (ARM+again, ARM+name)",
    )
    g.add_argument(
        "--arm-env",
        action="append",
        default=[],
        metavar="ARM='VAR=value ...'",
        help="environment for one arm's server only (repeatable), e.g. "
        "ddtree@32+eagerkv='SGLANG_DDTREE_EAGER_DRAFT_KV=1'; an arm's also reaches its variants",
    )
    g.add_argument(
        "--arms",
        default=DEFAULT_ARMS,
        help=f"comma-separated arms (default {DEFAULT_ARMS}): plain, dflash, chain, ddtree, ddtree@B, "
        "ddtree@auto, ddtree@autoB, and ARM+again (a second server of ARM: the run's A/A), ARM+phases "
        "(ARM with the DDTREE phase timer: host time per round phase in the report), ARM+heapq (ARM with "
        "its tree built by Python's heapq on the host, as SGLang's own DDTree builds it) or ARM+name (a "
        "variant with its own --arm-args/--arm-env)",
    )
    g.add_argument(
        "--budget", type=int, default=None, help="DDTREE budget of the ddtree arm (default 32; 16 with --cpu)"
    )
    g.add_argument(
        "--block-size", type=int, default=None, help="drafter block size (default: its config.json)"
    )
    g.add_argument(
        "--baseline",
        default=None,
        help="arm the others are compared with (default: plain, else dflash, else chain)",
    )


def _add_schedule_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("schedule")
    g.add_argument(
        "--schedule",
        choices=("auto", "interleaved", "alternating"),
        default="auto",
        help="interleaved: every server up at once, passes interleaved; alternating: one server at a time, "
        "A B A B ...; auto (default): interleaved where the servers fit in memory together (always on a "
        "CPU; on GPUs by --mem-fraction-static, given or estimated)",
    )
    g.add_argument("--repeats", type=int, default=3, help="timed passes per arm and level (per start)")
    g.add_argument(
        "--starts",
        type=int,
        default=2,
        help="alternating schedule: how many times each arm's server is started",
    )
    g.add_argument(
        "--prelaunch",
        action="store_true",
        help="alternating schedule: launch the next server while the current one runs its passes, held "
        "by SGLang's gate (--gated-launch-port) before it takes any GPU memory, and let it in once the "
        "current one has stopped: its imports and process start-up (about a minute a start on one GPU) "
        "overlap the passes instead of adding to the run",
    )
    g.add_argument(
        "--keep-going",
        action="store_true",
        help="an arm whose server does not start (or fails its side-check) is dropped and reported, and "
        "the others are measured (default: the run fails)",
    )
    g.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds from the start after which nothing new begins: no pass (interleaved) or no server "
        "start (alternating: a server started before it runs all its passes); what is left is reported "
        "as skipped",
    )
    g.add_argument(
        "--wait-file",
        default=None,
        metavar="FILE",
        help="start the servers, then wait until FILE exists before the first pass (another job sharing "
        "the machine, e.g. a test suite, runs meanwhile; alternating: the first server waits)",
    )


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load (sglang.bench_serving)")
    g.add_argument(
        "--dataset",
        choices=("random", "random-ids", "custom"),
        default=None,
        help="random: SGLang's random dataset (ShareGPT text cut to --input-len; downloads ShareGPT unless "
        "--dataset-path); random-ids: random token ids, no download; custom: prompts from a local file "
        "(--dataset-path: JSONL or a JSON array of text, token ids or objects with input_ids/prompt/text/"
        "conversations; default: built-in prompts), whose first prompts also serve the greedy check. "
        "Default: random-ids with --cpu, else random",
    )
    g.add_argument(
        "--dataset-path", default=None, help="ShareGPT JSON for random, or a prompts file for custom"
    )
    g.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="custom dataset, text prompts: wrap them in the chat template",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer for bench_serving (default: the server's)")
    g.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="random datasets: prompt tokens (default 256; 64 with --cpu)",
    )
    g.add_argument("--output-len", type=int, default=256, help="output tokens per request (ignore_eos)")
    g.add_argument(
        "--range-ratio",
        type=float,
        default=1.0,
        help="output (and random input) lengths drawn from [ratio*len, len], the same for every arm (1: fixed)",
    )
    g.add_argument("--concurrency", default="1,4,16,64", help="comma-separated --max-concurrency values")
    g.add_argument(
        "--num-prompts",
        default="auto",
        help="prompts per pass: one value, one per concurrency level, or auto (4 x concurrency, at least 16)",
    )
    g.add_argument("--seed", type=int, default=1, help="dataset seed, the same for every arm")
    g.add_argument(
        "--warmup-requests",
        default="auto",
        help="bench_serving warm-up requests before each pass (auto: the level's concurrency, its batch shape)",
    )
    g.add_argument("--bench-args", default="", help="extra flags for every bench_serving pass (one string)")


def _add_profile_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("diagnostics (the arm ARM+phases: docs/ab.md)")
    g.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="ARM@C",
        help="after ARM's passes at concurrency C (its first server), C requests of the run's prompts "
        "decoding together under SGLang's torch profiler (/start_profile, --profile-steps steps, no "
        "Python stacks), summarised per round into the series: GPU busy and idle time, GPU time by kind "
        "of kernel (all-reduce among them), launches, syncs, DDTREE phases where timed (repeatable, or "
        "comma-separated; e.g. ddtree@32@8)",
    )
    g.add_argument(
        "--profile-steps",
        type=int,
        default=DEFAULT_PROFILE_STEPS,
        help=f"scheduler steps each profile records (default {DEFAULT_PROFILE_STEPS})",
    )


def _add_check_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("greedy side-check")
    g.add_argument(
        "--check-prompts",
        type=int,
        default=4,
        help=f"greedy prompts per server (0..{len(CHECK_PROMPTS)}; 0: off)",
    )
    g.add_argument("--check-tokens", type=int, default=32, help="greedy tokens per prompt")
    g.add_argument(
        "--allow-greedy-mismatch",
        action="store_true",
        help="report greedy mismatches without failing (bf16 on GPUs can flip a near-tied argmax)",
    )
    g.add_argument(
        "--greedy-margin",
        type=float,
        default=BF16_MARGIN,
        metavar="NATS",
        help="a divergence from the baseline is rounding, not a failure, where the baseline's own "
        "forward gave the arm's token a log-prob within NATS of its argmax's (its two best "
        "log-probs at the first different token; any baseline arm). bf16 on a GPU can "
        "flip a near-tied argmax; a wrong tree or a stale KV entry misses by whole nats. "
        f"0: token identity only (default {BF16_MARGIN})",
    )


def _add_results_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("results")
    g.add_argument("--results-dir", default="results", help="where the series goes (default ./results)")
    g.add_argument("--label", default=None, help="the series' model part (default: the model folder's name)")
    g.add_argument(
        "--device-name", default=None, help="the series' device part (default: cpu, or the GPU's, e.g. h200)"
    )
    g.add_argument("--what", default="ab", help="the series' last part (default ab)")
    g.add_argument("--series", default=None, help="the whole series name (default <label>_<device>_<what>)")
    g.add_argument("--no-index", action="store_true", help="leave the results folder's README.md as it is")
    g.add_argument("--raw-dir", default=None, help="server and bench logs (default: a new temporary folder)")
    g.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        help="seconds to wait for a server (600 with --cpu, else 3600)",
    )
    g.add_argument(
        "--bench-timeout", type=float, default=3600.0, help="seconds one bench_serving pass may take"
    )
    g.add_argument(
        "--strict-parity", action="store_true", help="fail when the arms' overlap/CUDA-graph settings differ"
    )
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="start nothing: print the schedule, every arm's launch command and the passes, and check "
        "every arm's flags with SGLang's own argument parser",
    )
