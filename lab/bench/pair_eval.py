"""Acceptance of DDTree against the DFlash chain on a trained target + drafter pair,
through real SGLang servers on the CPU.

Held-out prompts (cut from files the pair never trained on) go to one server per
arm, one request at a time, greedy and then sampled at T=1:

* ``plain`` - no speculation: the greedy reference;
* ``chain`` - the same drafter as a DFlash chain (``SGLANG_DDTREE_MAX_TOPK=1``,
  budget ``block-1``);
* ``tree-b<N>`` - DDTree with budget ``N`` in {block-1, 16, 32, 64} (default top-k).

Per arm and temperature: tokens per round (accepted drafts + the bonus token, the
accept length), the share of accepted tokens that came through non-argmax
branches, target forwards per output token (decode rounds + prefills over
output tokens), and at greedy whether the output is token-identical to ``plain``.
The numbers come from the worker's ``DDTREE stats`` log lines
(``SGLANG_DDTREE_LOG_STATS_EVERY=1``); SGLang's ``avg_spec_accept_length`` is kept
as a cross-check. An offline replay (the training code's models in plain torch,
the reference tree builder) predicts the greedy accept length of each arm from
the same outputs, so a server that ran the drafter differently from how it was
trained would show up as a gap.

    SGLANG_USE_CPU_ENGINE=1 python -m lab.bench.pair_eval [--pair DIR] [--prompts 16]

Writes ``results/pair_eval_<pair>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from lab.bench._stamp import results_dir, write_outputs
from lab.bench.pair_eval_replay import offline_replay
from lab.bench.pair_eval_report import machine_stamp, markdown, plot, summarize
from lab.bench.pair_eval_serving import COMMON, arms_for, run_arm
from sglang_ddtree.config import cpu_engine_requested
from sglang_ddtree.launch import ServerStartError

DEFAULT_PAIR = Path(__file__).resolve().parents[1] / "models" / "pairs" / "pycode-4l"


def load_pair(path: Path, drafter: str = "drafter") -> dict:
    """The pair at ``path``, served with its drafter folder ``drafter`` (another one, from
    ``lab.models.train_drafter``, brings its own spec in its manifest)."""
    drafter_cfg = json.loads((path / drafter / "config.json").read_text())
    manifest = json.loads((path / "manifest.json").read_text())
    if drafter != "drafter":
        manifest = {**manifest, "spec": json.loads((path / drafter / "manifest.json").read_text())["spec"]}
    return {
        "path": path,
        "name": path.name if drafter == "drafter" else f"{path.name}-{drafter}",
        "target": path / "target",
        "drafter": path / drafter,
        "block": int(drafter_cfg["block_size"]),
        "prompts": json.loads((path / "heldout_prompts.json").read_text()),
        "manifest": manifest,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pair", type=Path, default=DEFAULT_PAIR)
    parser.add_argument("--drafter", default="drafter", help="the pair's drafter folder to serve")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", default="", help="tree budgets (default: block-1,16,32,64)")
    parser.add_argument("--no-sampling", action="store_true", help="greedy only")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline replay")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: results)")
    parser.add_argument("--name", default=None, help="output name (default: pair_eval_<pair>)")
    args = parser.parse_args(argv)
    if not cpu_engine_requested():
        print("error: the evaluation serves on the CPU; run it with SGLANG_USE_CPU_ENGINE=1")
        return 2
    from tqdm import tqdm

    torch.set_num_threads(1)
    pair = load_pair(args.pair, args.drafter)
    block = pair["block"]
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else [block - 1, 16, 32, 64]
    arms = arms_for(block, budgets)
    prompts = pair["prompts"][: args.prompts]
    phases = {"greedy": {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
    if not args.no_sampling:
        phases["sample"] = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    requests = len(prompts) * (1 + (len(arms) - 1) * len(phases))
    results = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pair-eval-") as logdir:
        bar = tqdm(total=requests, unit="req", dynamic_ncols=True, file=sys.stderr)
        try:
            for arm in arms:
                results.append(run_arm(pair, arm, prompts, phases, Path(logdir), bar))
        except ServerStartError as error:
            bar.close()
            print(f"error: {error}")
            return 1
        bar.close()
    greedy = results[0]["phases"]["greedy"]["outputs"]
    offline = {} if args.no_offline else offline_replay(pair, prompts, greedy, arms)
    data = {
        "pair": pair["name"],
        "stamp": machine_stamp(),
        "config": {
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "block": block,
            "budgets": budgets,
            "server_args": COMMON,
            "phases": phases,
            "pair_manifest": {
                k: pair["manifest"].get(k) for k in ("name", "created_utc", "sizes", "target", "drafter")
            },
        },
        "rows": summarize(results, offline),
        "results": results,
        "seconds": time.perf_counter() - started,
    }
    out = results_dir(args.out)
    name = args.name or f"pair_eval_{pair['name']}"
    md = markdown(data)
    paths = write_outputs(out, name, data, md)
    png = plot(out / f"{name}.png", data)
    print(md)
    print("wrote " + ", ".join(str(p) for p in [*paths, png] if p))
    return 0 if all(r["greedy_identical_to_plain"] for r in data["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
