"""Demo: the real SGLang server with ``--speculative-algorithm DDTREE`` on a CPU.

Builds (or reuses) the tiny models, starts a non-speculative server and a DDTREE
server in turn, sends the same greedy requests to both and prints a summary:
tokens, accept length, time, and whether the outputs are identical.

    SGLANG_USE_CPU_ENGINE=1 python -m sglang_ddtree.demo [--budget 16] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import sys
import time

from .config import cpu_engine_requested
from .launch import ServerProcess, ServerStartError, cpu_server_args
from .models.tiny import build_tiny_models

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Speculative decoding drafts tokens cheaply and",
    "for i in range(10):",
]


def _run_arm(name: str, args: list[str], max_new_tokens: int) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    print(f"[demo] starting the {name} server ...", flush=True)
    with ServerProcess(args, name=name) as server:
        started = time.perf_counter()
        outputs = [server.generate({"text": p, "sampling_params": params}) for p in PROMPTS]
        elapsed = time.perf_counter() - started
        accept = server.accept_length()
    tokens = sum(len(o["output_ids"]) for o in outputs)
    return {
        "name": name,
        "outputs": [o["output_ids"] for o in outputs],
        "texts": [o["text"] for o in outputs],
        "tokens": tokens,
        "seconds": elapsed,
        "accept_length": accept,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=16, help="DDTREE tree budget (nodes per round)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    if not cpu_engine_requested():
        print("error: the demo serves on the CPU; run it with SGLANG_USE_CPU_ENGINE=1 (make demo does).")
        return 2

    models = build_tiny_models()
    common = ["--dtype", "float32", "--decode-log-interval", "1", "--log-level", "warning"]
    plain = cpu_server_args(models.target, common)
    ddtree = cpu_server_args(
        models.target,
        [
            *common,
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-draft-model-path",
            str(models.drafter),
            "--speculative-ddtree-budget",
            str(args.budget),
        ],
    )
    try:
        arms = [_run_arm("plain", plain, args.max_new_tokens), _run_arm("ddtree", ddtree, args.max_new_tokens)]
    except ServerStartError as error:
        print(f"error: {error}")
        return 1

    print()
    print(f"{'arm':<8} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'accept length':>14}")
    for arm in arms:
        accept = "-" if arm["accept_length"] is None else f"{arm['accept_length']:.2f}"
        rate = arm["tokens"] / arm["seconds"]
        print(
            f"{arm['name']:<8} {len(PROMPTS):>8} {arm['tokens']:>7} {arm['seconds']:>8.2f} {rate:>7.1f} {accept:>14}"
        )
    identical = arms[0]["outputs"] == arms[1]["outputs"]
    print(f"\ngreedy outputs identical: {'yes' if identical else 'NO'}")
    print(f"sample ({PROMPTS[0]!r}): {arms[1]['texts'][0]!r}")
    print(
        "\nNote: the tiny drafter has random weights, so its drafts are almost never right and the "
        "accept length stays near 1; tests/test_serving_tree.py shows the tree accepting through "
        "siblings with a controlled drafter."
    )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
