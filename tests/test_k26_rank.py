"""The K2.6-rank model folder as SGLang reads it: architecture, MLA and MoE widths of one
TP-8 rank, and the INT4 scheme landing on the routed experts only (the Marlin MoE path)."""

from __future__ import annotations

import json

import pytest
import torch

from lab.models.k26_rank import K26, TP, drafter_config, rank_config, weight_bytes, write_rank


@pytest.fixture(scope="module")
def rank(tmp_path_factory):
    return write_rank(tmp_path_factory.mktemp("k26"))


def test_sglang_reads_the_rank_as_deepseek_v3_mla_at_one_eighth_width(rank):
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    config = ModelConfig(str(rank["target"]), dtype="bfloat16")
    hf = config.hf_config
    assert hf.architectures == ["DeepseekV3ForCausalLM"]
    assert config.attention_arch == AttentionArch.MLA
    assert config.num_attention_heads == K26["heads"] // TP == 8
    assert (config.kv_lora_rank, config.qk_rope_head_dim, hf.q_lora_rank) == (512, 64, 1536)
    assert (hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size) == (384, 8, 256)
    assert hf.intermediate_size == 18432 // TP and hf.first_k_dense_replace == 1
    assert config.vocab_size == 163840 and config.num_hidden_layers == 61
    assert config.quantization == "compressed-tensors"


@pytest.mark.parametrize(
    ("name", "quantized"),
    [
        ("model.layers.1.mlp.experts.0.gate_proj", True),
        ("model.layers.60.mlp.experts.383.down_proj", True),
        ("model.layers.1.self_attn.fused_qkv_a_proj_with_mqa", False),
        ("model.layers.1.self_attn.o_proj", False),
        ("model.layers.1.mlp.shared_experts.gate_up_proj", False),
        ("model.layers.0.mlp.gate_up_proj", False),
        ("lm_head", False),
    ],
)
def test_int4_group32_on_routed_experts_only(rank, name, quantized):
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    config = json.loads((rank["target"] / "config.json").read_text())
    quant = CompressedTensorsConfig.from_config(config["quantization_config"])
    scheme = quant.get_scheme_dict(torch.nn.Linear(1, 1), name)
    assert (scheme is not None) == quantized
    if quantized:
        weights = scheme["weights"]
        assert (weights.num_bits, weights.group_size, weights.symmetric) == (4, 32, True)
        assert quant._is_wNa16_group_channel(weights, scheme.get("input_activations"))


def test_drafter_matches_the_published_kimi_dflash_shape(rank):
    drafter = json.loads((rank["drafter"] / "config.json").read_text())
    assert drafter["architectures"] == ["DFlashDraftModel"]
    assert drafter["hidden_size"] == 7168 and drafter["num_hidden_layers"] == 6
    assert drafter["block_size"] == 8 and drafter["num_target_layers"] == 61
    assert drafter["dflash_config"]["target_layer_ids"] == [1, 12, 24, 35, 47, 58]
    assert drafter["num_attention_heads"] == 64 // TP


def test_drafter_rope_is_the_published_yarn_in_the_style_sglangs_fused_paths_serve(rank):
    """SGLang's fused drafter paths (context KV, q/k norm + RoPE) need neox style with the
    rotary over the whole head; an interleaved drafter takes the per-layer paths."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.utils.hf_transformers_utils import get_rope_config

    hf = ModelConfig(str(rank["drafter"]), dtype="bfloat16").hf_config
    theta, scaling = get_rope_config(hf)  # as SGLang's DFlash attention reads them
    assert bool(getattr(hf, "rope_is_neox_style", getattr(hf, "is_neox_style", True)))
    assert (scaling["rope_type"], scaling["factor"], scaling["original_max_position_embeddings"]) == (
        "yarn",
        64.0,
        4096,
    )
    assert theta == 50000.0 and not {"rope_dim", "partial_rotary_factor"} & set(scaling)
    assert getattr(hf, "partial_rotary_factor", 1.0) == 1.0


def test_short_rank_keeps_the_shapes_and_a_drafter_within_its_layers(tmp_path):
    paths = write_rank(tmp_path, layers=3, quantized=False)
    target = json.loads((paths["target"] / "config.json").read_text())
    drafter = json.loads((paths["drafter"] / "config.json").read_text())
    assert target["num_hidden_layers"] == 3 and "quantization_config" not in target
    assert drafter["dflash_config"]["target_layer_ids"] == [0, 1]
    with pytest.raises(ValueError):
        rank_config(layers=1)


@pytest.mark.parametrize("layers", [2, 3, 4, 7, 12, 60, 61])
def test_every_drafter_tap_is_captured_by_sglang(layers):
    """SGLang captures tap ``i`` as the input of layer ``i + 1``
    (``DeepseekV2ForCausalLM.set_dflash_layers_to_capture``); a tap on the last layer is never
    captured and the server's graph capture fails ("captured 2 of 3 aux hidden states", seen on
    a 3-layer rank)."""
    taps = drafter_config(layers)["dflash_config"]["target_layer_ids"]
    captured = [i + 1 for i in taps]
    assert taps == sorted(set(taps)) and min(taps) >= 0
    assert all(layer < layers for layer in captured)
    assert len(taps) == min(6, layers - 1)


def test_rank_weight_budget_fits_one_h200():
    sizes = weight_bytes(rank_config())
    # 60 MoE layers x 384 experts x 3 x 7168 x 256 at 4.5 bits: the bulk of the rank
    assert 70 < sizes["moe_gb"] < 75
    assert 75 < sizes["total_gb"] < 90


def test_the_online_budget_log_interval_is_checked(monkeypatch):
    from sglang_ddtree.config import ENV_ONLINE_BUDGET_LOG_EVERY, DDTreeConfigError, online_budget_log_every

    assert online_budget_log_every(1000) == 1000
    monkeypatch.setenv(ENV_ONLINE_BUDGET_LOG_EVERY, "50")
    assert online_budget_log_every(1000) == 50
    monkeypatch.setenv(ENV_ONLINE_BUDGET_LOG_EVERY, "-1")
    with pytest.raises(DDTreeConfigError, match="non-negative"):
        online_budget_log_every(1000)
