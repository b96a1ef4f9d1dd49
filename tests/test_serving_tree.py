"""What the tree buys, through the real server: a drafter whose proposals the test
controls puts the right token at rank 1 at some depths. A chain cannot accept
past those depths; the tree must, and output must stay identical to
non-speculative decoding."""

from __future__ import annotations

import ast
import re

import pytest
from transformers import AutoTokenizer

from serving import GREEDY, PROMPTS, ddtree_args, plain_args, run_server, write_json

pytestmark = pytest.mark.server

RANKS = [0, 1, 0, 0, 1, 0, 0]  # rank of the right token at depths 1..7


def _requests(tokenizer):
    return [{"input_ids": tokenizer(p)["input_ids"], "sampling_params": GREEDY} for p in PROMPTS]


def _run(server, requests):
    return [server.generate(r)["output_ids"] for r in requests]


def _last_stats(log_path) -> dict:
    lines = [line for line in log_path.read_text().splitlines() if "DDTREE stats:" in line]
    assert lines, "no DDTREE stats line in the server log"
    return ast.literal_eval(re.sub(r"^.*DDTREE stats: ", "", lines[-1]))


@pytest.fixture(scope="module")
def oracle(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oracle")
    tokenizer = AutoTokenizer.from_pretrained(tiny.target)
    requests = _requests(tokenizer)
    with run_server(plain_args(tiny), name="plain") as server:
        expected = _run(server, requests)
    continuations = [r["input_ids"] + out for r, out in zip(requests, expected)]
    path = write_json(tmp / "oracle.json", {"continuations": continuations, "ranks": RANKS})
    return requests, expected, path, tmp


def _ddtree(tiny, oracle, budget, max_topk=None):
    requests, expected, path, tmp = oracle
    env = {"SGLANG_DDTREE_ORACLE_DRAFT": str(path), "SGLANG_DDTREE_LOG_STATS_EVERY": "1"}
    if max_topk is not None:
        env["SGLANG_DDTREE_MAX_TOPK"] = str(max_topk)
    name = f"ddtree-b{budget}-k{max_topk}"
    args = ddtree_args(tiny, budget=budget, extra=["--log-level", "info"])
    with run_server(args, env=env, name=name, tmp=tmp) as server:
        outputs = _run(server, requests)
        accept_length = server.accept_length()
    return outputs, accept_length, _last_stats(tmp / f"{name}.log")


def test_tree_accepts_through_siblings_and_beats_the_chain(tiny, oracle):
    _, expected, _, _ = oracle
    chain_out, chain_accept, chain_stats = _ddtree(tiny, oracle, budget=7, max_topk=1)
    tree_out, tree_accept, tree_stats = _ddtree(tiny, oracle, budget=32)
    assert chain_out == expected
    assert tree_out == expected
    # the chain stops at the first rank-1 depth: one draft + bonus per round
    assert chain_stats["non_argmax_share"] == 0.0
    assert chain_accept < 2.2
    # the tree reaches depth 4 through a sibling at depth 2
    assert tree_stats["non_argmax_share"] > 0.1
    assert tree_accept > chain_accept + 1.0
    assert tree_stats["mean_tree_nodes"] == pytest.approx(32.0)
