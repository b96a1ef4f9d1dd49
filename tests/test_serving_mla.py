"""The Kimi K2.x architecture family (DeepseekV3: MLA attention over a latent KV
cache, MoE with a shared expert, first layer dense) served with DDTREE on CPU:
tree-masked verify through the absorbed-MLA path, rope at tree positions, KV
commit in the latent pool. Output must equal the non-speculative server, with
tokens accepted through non-argmax branches."""

from __future__ import annotations

import pytest
from serving import (
    PROMPTS,
    ddtree_args,
    generate_batch,
    last_tree_stats,
    oracle_env,
    oracle_reference,
    output_ids,
    plain_args,
    run_all,
    run_server,
)

from sglang_ddtree.models.tiny import TinySpec, build_tiny_models

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def mla_models():
    models = build_tiny_models(TinySpec(arch="deepseek_v3"))
    config = (models.target / "config.json").read_text()
    assert '"DeepseekV3ForCausalLM"' in config and '"kv_lora_rank"' in config
    return models


def test_mla_moe_target_greedy_identical_with_tree_acceptance(mla_models, tmp_path):
    with run_server(plain_args(mla_models), name="mla-plain", tmp=tmp_path) as server:
        reference = oracle_reference(server, mla_models, tmp_path)
    requests, expected = reference["requests"], reference["greedy"]
    args = ddtree_args(mla_models, budget=32, extra=["--log-level", "info"])
    with run_server(args, env=oracle_env(reference["oracle"]), name="mla-ddtree", tmp=tmp_path) as server:
        sequential = output_ids(run_all(server, requests))
        batched = generate_batch(server, PROMPTS)  # 8 requests in flight, text prompts
        accept_length = server.accept_length()
    assert sequential == expected
    assert batched == expected
    stats = last_tree_stats(tmp_path / "mla-ddtree.log")
    assert stats["non_argmax_share"] > 0.1
    assert accept_length > 3.0
    log = (tmp_path / "mla-ddtree.log").read_text()
    assert "MLA on torch_native" in log  # the absorbed-MLA verify path ran
