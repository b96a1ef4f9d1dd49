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

    SGLANG_USE_CPU_ENGINE=1 python -m sglang_ddtree.bench.pair_eval [--pair DIR] [--prompts 16]

Writes ``bench_results/pair_eval_<pair>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import cpu_engine_requested
from ..launch import ServerProcess, ServerStartError, cpu_server_args
from ._stamp import md_table, results_dir, stamp, write_outputs

DEFAULT_PAIR = Path(__file__).resolve().parents[1] / "models" / "pairs" / "pycode-4l"
COMMON = [
    "--dtype",
    "float32",
    "--decode-log-interval",
    "1",
    "--log-level",
    "info",
    "--disable-overlap-schedule",
]


@dataclass(frozen=True)
class Arm:
    name: str
    budget: int | None = None  # None: no speculation
    max_topk: int | None = None  # 1: the DFlash chain

    @property
    def speculative(self) -> bool:
        return self.budget is not None


def arms_for(block: int, budgets: list[int]) -> list[Arm]:
    arms = [Arm("plain"), Arm("chain", block - 1, 1)]
    arms += [Arm(f"tree-b{b}", b) for b in budgets]
    return arms


def load_pair(path: Path) -> dict:
    drafter_cfg = json.loads((path / "drafter" / "config.json").read_text())
    return {
        "path": path,
        "name": path.name,
        "target": path / "target",
        "drafter": path / "drafter",
        "block": int(drafter_cfg["block_size"]),
        "prompts": json.loads((path / "heldout_prompts.json").read_text()),
        "manifest": json.loads((path / "manifest.json").read_text()),
    }


def server_args(pair: dict, arm: Arm) -> list[str]:
    extra = list(COMMON)
    if arm.speculative:
        extra += [
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-draft-model-path",
            str(pair["drafter"]),
            "--speculative-ddtree-budget",
            str(arm.budget),
        ]
    return cpu_server_args(pair["target"], extra)


def server_env(arm: Arm) -> dict[str, str]:
    env = {"SGLANG_DDTREE_LOG_STATS_EVERY": "1", "PYTHONUNBUFFERED": "1"}
    if arm.max_topk is not None:
        env["SGLANG_DDTREE_MAX_TOPK"] = str(arm.max_topk)
    return env


# --------------------------------------------------------------------------- stats


def stats_totals(log_path: Path) -> dict:
    """Cumulative counters from the last ``DDTREE stats`` line of a server log."""
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if "DDTREE stats:" in line]
    if not lines:
        return {"request_rounds": 0, "accepted": 0, "non_argmax": 0, "nodes": 0}
    d = ast.literal_eval(re.sub(r"^.*DDTREE stats: ", "", lines[-1]))
    requests = int(d["request_rounds"])
    accepted = round(d["accepted_drafts_per_round"] * requests)
    return {
        "request_rounds": requests,
        "accepted": accepted,
        "non_argmax": round(d["non_argmax_share"] * max(accepted, 1)),
        "nodes": round(d["mean_tree_nodes"] * requests),
    }


def phase_metrics(before: dict, after: dict, outputs: list[list[int]], prompts: int) -> dict:
    rounds = after["request_rounds"] - before["request_rounds"]
    accepted = after["accepted"] - before["accepted"]
    non_argmax = after["non_argmax"] - before["non_argmax"]
    tokens = sum(len(o) for o in outputs)
    return {
        "output_tokens": tokens,
        "decode_rounds": rounds,
        "tokens_per_round": (accepted + rounds) / max(rounds, 1),
        "accepted_drafts_per_round": accepted / max(rounds, 1),
        "non_argmax_share": non_argmax / max(accepted, 1),
        "mean_tree_nodes": (after["nodes"] - before["nodes"]) / max(rounds, 1),
        "target_forwards_per_token": (rounds + prompts) / max(tokens, 1),
    }


# --------------------------------------------------------------------------- serving


def run_arm(pair: dict, arm: Arm, prompts: list[dict], phases: dict[str, dict], logdir: Path, bar) -> dict:
    log_path = logdir / f"{arm.name}.log"
    server = ServerProcess(server_args(pair, arm), env=server_env(arm), log_path=log_path, name=arm.name)
    bar.set_description(f"{arm.name}: starting")
    result: dict = {"arm": arm.name, "budget": arm.budget, "max_topk": arm.max_topk, "phases": {}}
    with server:
        for phase, params in phases.items():
            if phase != "greedy" and not arm.speculative:
                continue
            bar.set_description(f"{arm.name}: {phase}")
            before = stats_totals(log_path)
            started = time.perf_counter()
            outputs = []
            for i, prompt in enumerate(prompts):
                sampling = dict(params)
                if sampling.get("temperature", 0) > 0:
                    sampling["sampling_seed"] = 1000 + i
                out = server.generate({"input_ids": prompt["input_ids"], "sampling_params": sampling})
                outputs.append(out["output_ids"])
                bar.update(1)
            seconds = time.perf_counter() - started
            entry = {"seconds": seconds, "outputs": outputs}
            if arm.speculative:
                entry.update(phase_metrics(before, stats_totals(log_path), outputs, len(prompts)))
                if phase == "greedy":
                    entry["sglang_avg_spec_accept_length"] = server.accept_length()
            else:
                tokens = sum(len(o) for o in outputs)
                entry.update(output_tokens=tokens, tokens_per_round=1.0, target_forwards_per_token=1.0)
            result["phases"][phase] = entry
    return result


# --------------------------------------------------------------------------- offline replay


@torch.no_grad()
def _greedy_posterior(tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The target's greedy token after every slot, known from the plain server's output:
    the token after position ``p`` is ``tokens[p + 1]`` on the slots the walk can reach
    (those matching the output so far); -1 (no token) past the end of the output."""
    nxt = positions + 1
    return np.where(nxt < len(tokens), tokens[np.minimum(nxt, len(tokens) - 1)], -1)


def offline_replay(
    pair: dict, prompts: list[dict], greedy: list[list[int]], arms: list[Arm]
) -> dict[str, float]:
    """Greedy tokens per round each arm should reach, replaying the server's rounds
    on the plain server's output with the training code's models (float32)."""
    from safetensors.torch import load_file

    from ..models.pair_modules import Drafter, PairSpec, Target, block_layout
    from ..tree.round import reference_round

    spec_fields = dict(pair["manifest"]["spec"])
    spec_fields["target_layer_ids"] = tuple(spec_fields["target_layer_ids"])
    spec = PairSpec(**spec_fields)
    vocab = int(pair["manifest"]["tokenizer"]["vocab_size"])
    mask_id = int(pair["manifest"]["tokenizer"]["mask_token_id"])
    target, drafter = Target(spec, vocab), Drafter(spec)
    target.load_state_dict({k: v.float() for k, v in load_file(pair["target"] / "model.safetensors").items()})
    weights = {k: v.float() for k, v in load_file(pair["drafter"] / "model.safetensors").items()}
    weights["mask_embedding"] = target.model.embed_tokens.weight[mask_id].clone()
    drafter.load_state_dict(weights)
    block = spec.block_size
    rounds = {arm.name: [] for arm in arms if arm.speculative}
    for prompt, out in zip(prompts, greedy):
        seq = torch.tensor([prompt["input_ids"] + out])
        start, length = len(prompt["input_ids"]), seq.shape[1]
        _, feats = target(seq, capture=spec.target_layer_ids)
        anchors = torch.arange(start, length)[None]
        pos, mask = block_layout(anchors, length, block)
        block_ids = torch.full_like(pos, mask_id)
        block_ids[:, ::block] = seq[:, start:]
        hidden = drafter(target.model.embed_tokens(block_ids), pos, feats, mask)
        logits = target.logits(hidden.view(-1, block, hidden.shape[-1])[:, 1:])  # [anchors, block-1, vocab]
        greedy_tokens = seq[0].numpy()
        for arm in arms:
            if not arm.speculative:
                continue
            a = start
            while a < length - 1:  # the server stops once the output is complete
                result = reference_round(
                    logits[a - start][None],
                    greedy_tokens[a : a + 1],
                    np.array([a]),
                    lambda layout, positions, tokens=greedy_tokens: _greedy_posterior(tokens, positions),
                    arm.budget,
                    max_topk=arm.max_topk,
                )
                accepted = int(result.acceptance.accept_lens[0])
                rounds[arm.name].append(accepted + 1)
                a += accepted + 1
    return {name: sum(r) / max(len(r), 1) for name, r in rounds.items()}


# --------------------------------------------------------------------------- report


def machine_stamp() -> dict:
    info = stamp()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor()
    import os

    info.update(cpu=cpu, cpu_count=os.cpu_count(), platform=platform.platform())
    for package in ("sglang", "transformers"):
        try:
            info[package] = __import__(package).__version__
        except Exception:  # noqa: BLE001 - a missing version is reported as None
            info[package] = None
    return info


def summarize(results: list[dict], offline: dict[str, float]) -> list[dict]:
    plain = next(r for r in results if r["arm"] == "plain")["phases"]["greedy"]["outputs"]
    rows = []
    for r in results:
        g = r["phases"]["greedy"]
        s = r["phases"].get("sample", {})
        rows.append(
            {
                "arm": r["arm"],
                "budget": r["budget"],
                "max_topk": r["max_topk"],
                "greedy_tokens_per_round": g["tokens_per_round"],
                "greedy_offline_prediction": offline.get(r["arm"]),
                "greedy_non_argmax_share": g.get("non_argmax_share"),
                "greedy_target_forwards_per_token": g["target_forwards_per_token"],
                "greedy_identical_to_plain": g["outputs"] == plain,
                "sample_tokens_per_round": s.get("tokens_per_round"),
                "sample_non_argmax_share": s.get("non_argmax_share"),
                "sample_target_forwards_per_token": s.get("target_forwards_per_token"),
                "greedy_seconds": g["seconds"],
                "sglang_avg_spec_accept_length": g.get("sglang_avg_spec_accept_length"),
            }
        )
    return rows


def markdown(data: dict) -> str:
    rows = data["rows"]
    chain = next(r for r in rows if r["arm"] == "chain")

    def rel(value, base):
        return "-" if value is None or not base else f"{value / base:.2f}x"

    def num(value, fmt="{:.2f}"):
        return "-" if value is None else fmt.format(value)

    table = md_table(
        [
            "arm",
            "budget",
            "T=0 tokens/round",
            "vs chain",
            "offline prediction",
            "T=0 non-argmax share",
            "T=0 target fwd/token",
            "T=0 identical to plain",
            "T=1 tokens/round",
            "vs chain",
            "T=1 non-argmax share",
        ],
        [
            [
                r["arm"],
                "-"
                if r["budget"] is None
                else (f"{r['budget']} (top-1)" if r["max_topk"] == 1 else r["budget"]),
                num(r["greedy_tokens_per_round"]),
                rel(r["greedy_tokens_per_round"], chain["greedy_tokens_per_round"]) if r["budget"] else "-",
                num(r["greedy_offline_prediction"]),
                num(r["greedy_non_argmax_share"], "{:.1%}"),
                num(r["greedy_target_forwards_per_token"], "{:.3f}"),
                "yes" if r["greedy_identical_to_plain"] else "**NO**",
                num(r["sample_tokens_per_round"]),
                rel(r["sample_tokens_per_round"], chain["sample_tokens_per_round"]) if r["budget"] else "-",
                num(r["sample_non_argmax_share"], "{:.1%}"),
            ]
            for r in rows
        ],
    )
    st = data["stamp"]
    cfg = data["config"]
    return "\n".join(
        [
            f"# DDTree vs the DFlash chain on the trained pair `{data['pair']}`",
            "",
            f"{cfg['prompts']} held-out prompts, {cfg['max_new_tokens']} new tokens each, one request at a time; "
            f"drafter block {cfg['block']}; real SGLang servers on the CPU (float32, overlap off). "
            "tokens/round = accepted drafts + the bonus token (the accept length); non-argmax share = accepted "
            "tokens that a chain of the drafter's top-1 picks would not have proposed; target fwd/token = "
            "(decode rounds + prefills) / output tokens. T=1: acceptance only (outputs are samples).",
            "",
            table,
            "",
            f"machine: `{st.get('cpu')}` x{st.get('cpu_count')} | sglang `{st.get('sglang')}` | torch `{st.get('torch')}` "
            f"| commit `{st.get('commit')}` | date `{st.get('date_utc')}`",
        ]
    )


def plot(path: Path, data: dict) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = data["rows"]
    chain = next(r for r in rows if r["arm"] == "chain")
    trees = [r for r in rows if r["arm"].startswith("tree")]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for key, label, color in (("greedy", "T=0", "C0"), ("sample", "T=1", "C1")):
        xs = [r["budget"] for r in trees]
        ax.plot(
            xs,
            [r[f"{key}_tokens_per_round"] for r in trees],
            marker="o",
            color=color,
            label=f"DDTree {label}",
        )
        ax.axhline(chain[f"{key}_tokens_per_round"], ls="--", color=color, lw=1, label=f"chain {label}")
    offline = [r["greedy_offline_prediction"] for r in trees]
    if all(v is not None for v in offline):
        ax.plot(
            [r["budget"] for r in trees],
            offline,
            ls=":",
            marker="x",
            color="C0",
            label="DDTree T=0 offline replay",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget (nodes per round)")
    ax.set_ylabel("tokens per round (accept length)")
    ax.set_title(
        f"DDTree vs chain, trained pair {data['pair']} (block {data['config']['block']})", fontsize=10
    )
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pair", type=Path, default=DEFAULT_PAIR)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", default="", help="tree budgets (default: block-1,16,32,64)")
    parser.add_argument("--no-sampling", action="store_true", help="greedy only")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline replay")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: bench_results)")
    parser.add_argument("--name", default=None, help="output name (default: pair_eval_<pair>)")
    args = parser.parse_args(argv)
    if not cpu_engine_requested():
        print("error: the evaluation serves on the CPU; run it with SGLANG_USE_CPU_ENGINE=1")
        return 2
    from tqdm import tqdm

    torch.set_num_threads(1)
    pair = load_pair(args.pair)
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
