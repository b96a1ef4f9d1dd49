"""The served side of ``pair_eval``: one real SGLang server per arm (plain, the DFlash chain,
DDTree at each budget), the prompts sent one at a time, and the acceptance counters read back
from the worker's ``DDTREE stats`` log lines."""

from __future__ import annotations

import ast
import re
import time
from dataclasses import dataclass
from pathlib import Path

from sglang_ddtree.launch import ServerProcess, cpu_server_args

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
