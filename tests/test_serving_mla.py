"""The Kimi K2.x architecture family (DeepseekV3: MLA attention over a latent KV
cache, MoE with a shared expert, first layer dense) served with DDTREE on CPU:
tree-masked verify through the absorbed-MLA path, rope at tree positions, KV
commit in the latent pool. Output must equal the non-speculative server, with
tokens accepted through non-argmax branches.

The DDTREE server is the minimal launch (no budget flag): its endpoints answer, and
``/server_info`` shows the default budget."""

from __future__ import annotations

import functools
import json
import urllib.error
import urllib.request

import pytest
from serving import (
    PROMPTS,
    SHARED_SERVERS,
    ServerSpec,
    ddtree_args,
    generate_batch,
    last_tree_stats,
    oracle_env,
    oracle_reference,
    output_ids,
    plain_args,
    run_all,
    server_spec,
)

from lab.models.tiny import TinySpec, build_tiny_models

pytestmark = pytest.mark.server

MODULE = "test_serving_mla.py::"
DEFAULT_BUDGET = 32  # what a launch without --speculative-ddtree-budget serves


def mla_models():
    return build_tiny_models(TinySpec(arch="deepseek_v3"))


@functools.cache
def mla_servers() -> dict[str, ServerSpec]:
    """The DDTREE server is launched while the plain one answers: the drafter's script
    (``oracle.json`` in the folder) is written from those answers before its first request."""
    models, folder = mla_models(), SHARED_SERVERS.folder("mla")
    args = ddtree_args(models, budget=None, extra=["--log-level", "info"])
    return {
        "plain": server_spec(plain_args(models), name="mla-plain", tmp=folder),
        "ddtree": server_spec(args, oracle_env(folder / "oracle.json"), "mla-ddtree", folder),
    }


SHARED_SERVERS.plan(mla_servers, {"plain": MODULE, "ddtree": MODULE})


@pytest.fixture(scope="module")
def mla_reference(servers):
    """The plain server's greedy answers; the drafter's script is built from them."""
    models = mla_models()
    with servers.take(mla_servers()["plain"]) as server:
        return oracle_reference(server, models, SHARED_SERVERS.folder("mla"))


@pytest.fixture(scope="module")
def mla_tree(servers, mla_reference):
    with servers.take(mla_servers()["ddtree"]) as server:
        yield server


def test_mla_moe_target_greedy_identical_with_tree_acceptance(mla_reference, mla_tree):
    models = mla_models()
    config = (models.target / "config.json").read_text()
    assert '"DeepseekV3ForCausalLM"' in config and '"kv_lora_rank"' in config
    assert "--speculative-ddtree-budget" not in mla_tree.args
    requests, expected = mla_reference["requests"], mla_reference["greedy"]
    sequential = output_ids(run_all(mla_tree, requests))
    batched = generate_batch(mla_tree, PROMPTS)  # 8 requests in flight, text prompts
    accept_length = mla_tree.accept_length()
    assert sequential == expected
    assert batched == expected
    stats = last_tree_stats(mla_tree.log_path)
    assert stats["non_argmax_share"] > 0.1
    assert accept_length > 3.0
    log = mla_tree.log_path.read_text()
    assert "MLA on torch_native" in log  # the absorbed-MLA verify path ran


def test_minimal_launch_answers_every_endpoint(mla_tree):
    """Launched without a budget flag, the server's information endpoints answer 200 and
    ``/server_info`` shows the default budget."""
    answers = {}
    for path in ("/server_info", "/get_server_info", "/v1/models", "/health", "/health_generate"):
        try:
            with urllib.request.urlopen(f"{mla_tree.url}{path}", timeout=300) as response:
                answers[path] = (response.status, response.read().decode())
        except urllib.error.HTTPError as error:
            answers[path] = (error.code, error.read().decode(errors="replace"))
    assert {path: status for path, (status, _) in answers.items()} == dict.fromkeys(answers, 200), answers
    for path in ("/server_info", "/get_server_info"):
        info = json.loads(answers[path][1])
        assert info["speculative_algorithm"] == "DDTREE", path
        assert info["ddtree"]["budget"] == DEFAULT_BUDGET, (path, info["ddtree"])
    models = json.loads(answers["/v1/models"][1])
    assert [m["id"] for m in models["data"]] == [str(mla_models().target)]
