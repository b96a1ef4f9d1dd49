"""Demo: the real SGLang server with ``--speculative-algorithm DDTREE`` on a CPU.

Serves the small trained pair shipped with the package (a 4.5M-parameter Python-code
target and its 1.3M-parameter DFlash drafter, ``models/pairs/pycode-4l``) with three
arms in turn - no speculation, the DFlash chain (one candidate per depth) and
DDTREE - sends the same greedy held-out prompts to each and prints tokens, accept
length, time and whether every output is identical. ``--tiny`` uses the random
tiny models instead.

    SGLANG_USE_CPU_ENGINE=1 python -m lab.demo [--budget 32] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lab.models.tiny import build_tiny_models
from sglang_ddtree.config import cpu_engine_requested
from sglang_ddtree.launch import ServerProcess, ServerStartError, cpu_server_args

PAIR = Path(__file__).resolve().parent / "models" / "pairs" / "pycode-4l"
TINY_PROMPTS = ["The quick brown fox", "def add(a, b):", "Speculative decoding drafts", "for i in range(10):"]
NUM_PROMPTS = 4


def _prompts(use_tiny: bool) -> list[dict]:
    """Requests' inputs: held-out code prefixes of the pair (token ids), or text."""
    if use_tiny:
        return [{"text": p} for p in TINY_PROMPTS]
    held_out = json.loads((PAIR / "heldout_prompts.json").read_text())
    return [{"input_ids": p["input_ids"]} for p in held_out[:NUM_PROMPTS]]


def _run_arm(name: str, args: list[str], env: dict, prompts: list[dict], max_new_tokens: int) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    print(f"[demo] starting the {name} server ...", flush=True)
    with ServerProcess(args, env=env, name=name) as server:
        started = time.perf_counter()
        outputs = [server.generate({**p, "sampling_params": params}) for p in prompts]
        elapsed = time.perf_counter() - started
        accept = server.accept_length()
    return {
        "name": name,
        "outputs": [o["output_ids"] for o in outputs],
        "texts": [o["text"] for o in outputs],
        "tokens": sum(len(o["output_ids"]) for o in outputs),
        "seconds": elapsed,
        "accept_length": accept,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget", type=int, default=32, help="DDTREE tree budget (nodes per round)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--tiny", action="store_true", help="random tiny models instead of the trained pair")
    args = parser.parse_args(argv)
    if not cpu_engine_requested():
        print("error: the demo serves on the CPU; run it with SGLANG_USE_CPU_ENGINE=1 (make demo does).")
        return 2

    if args.tiny:
        models = build_tiny_models()
        target, drafter, block = models.target, models.drafter, models.spec.block_size
    else:
        target, drafter = PAIR / "target", PAIR / "drafter"
        block = json.loads((drafter / "config.json").read_text())["block_size"]
    common = ["--dtype", "float32", "--decode-log-interval", "1", "--log-level", "warning"]
    spec = ["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(drafter)]
    arms_args = [
        ("plain", cpu_server_args(target, common), {}),
        # the DFlash chain: one candidate per depth, block - 1 nodes
        (
            "chain",
            cpu_server_args(
                target,
                [
                    *common,
                    *spec,
                    "--speculative-ddtree-budget",
                    str(block - 1),
                    "--speculative-ddtree-max-topk",
                    "1",
                ],
            ),
            {},
        ),
        (
            "ddtree",
            cpu_server_args(target, [*common, *spec, "--speculative-ddtree-budget", str(args.budget)]),
            {},
        ),
    ]
    prompts = _prompts(args.tiny)
    try:
        arms = [_run_arm(name, a, env, prompts, args.max_new_tokens) for name, a, env in arms_args]
    except ServerStartError as error:
        print(f"error: {error}")
        return 1
    return _print_summary(arms, len(prompts), args)


def _print_summary(arms: list[dict], requests: int, args) -> int:
    print()
    print(f"{'arm':<8} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'accept length':>14}")
    for arm in arms:
        accept = "-" if arm["accept_length"] is None else f"{arm['accept_length']:.2f}"
        rate = arm["tokens"] / arm["seconds"]
        print(
            f"{arm['name']:<8} {requests:>8} {arm['tokens']:>7} {arm['seconds']:>8.2f} {rate:>7.1f} {accept:>14}"
        )
    identical = all(arm["outputs"] == arms[0]["outputs"] for arm in arms)
    print(f"\ngreedy outputs identical in every arm: {'yes' if identical else 'NO'}")
    print(f"sample continuation: {arms[-1]['texts'][0][:160]!r}")
    print(
        f"\naccept length = tokens emitted per verify round (1 + accepted drafts). ddtree verifies "
        f"{args.budget + 1} tokens per round, the chain one block; on a CPU the extra verify work "
        "costs more than it saves, so tok/s here is not the GPU story (docs/benchmarks.md)."
    )
    if args.tiny:
        print("--tiny: the drafter has random weights, so the accept length stays near 1.")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
