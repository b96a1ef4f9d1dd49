"""The Kimi K2.x architecture family (DeepseekV3: MLA attention over a latent KV
cache, MoE with a shared expert, first layer dense) served with DDTREE on CPU:
tree-masked verify through the absorbed-MLA path, rope at tree positions, KV
commit in the latent pool. Output must equal the non-speculative server, with
tokens accepted through non-argmax branches."""

from __future__ import annotations

import functools

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

TEST = "test_serving_mla.py::test_mla_moe_target_greedy_identical_with_tree_acceptance"


def mla_models():
    return build_tiny_models(TinySpec(arch="deepseek_v3"))


@functools.cache
def mla_servers() -> dict[str, ServerSpec]:
    """The DDTREE server is launched while the plain one answers: the drafter's script
    (``oracle.json`` in the folder) is written from those answers before its first request."""
    models, folder = mla_models(), SHARED_SERVERS.folder("mla")
    args = ddtree_args(models, budget=32, extra=["--log-level", "info"])
    return {
        "plain": server_spec(plain_args(models), name="mla-plain", tmp=folder),
        "ddtree": server_spec(args, oracle_env(folder / "oracle.json"), "mla-ddtree", folder),
    }


SHARED_SERVERS.plan(mla_servers, {"plain": TEST, "ddtree": TEST})


def test_mla_moe_target_greedy_identical_with_tree_acceptance(servers):
    models = mla_models()
    config = (models.target / "config.json").read_text()
    assert '"DeepseekV3ForCausalLM"' in config and '"kv_lora_rank"' in config
    specs = mla_servers()
    with servers.take(specs["plain"]) as server:
        reference = oracle_reference(server, models, SHARED_SERVERS.folder("mla"))
    requests, expected = reference["requests"], reference["greedy"]
    with servers.take(specs["ddtree"]) as server:
        sequential = output_ids(run_all(server, requests))
        batched = generate_batch(server, PROMPTS)  # 8 requests in flight, text prompts
        accept_length = server.accept_length()
    assert sequential == expected
    assert batched == expected
    stats = last_tree_stats(server.log_path)
    assert stats["non_argmax_share"] > 0.1
    assert accept_length > 3.0
    log = server.log_path.read_text()
    assert "MLA on torch_native" in log  # the absorbed-MLA verify path ran
