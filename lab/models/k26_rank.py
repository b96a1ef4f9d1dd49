"""One tensor-parallel rank of Kimi K2.6 (TP-8) as a model folder SGLang serves on one GPU.

    python -m lab.models.k26_rank --out /tmp/k26 [--layers 61] [--no-quant]

Writes ``<out>/target`` and ``<out>/drafter``: configs and tokenizer only, served with
``--load-format dummy`` (random weights, real shapes, no download). The target is SGLang's
``DeepseekV3ForCausalLM`` (the class Kimi K2.x checkpoints name) at the width each of the
eight GPUs holds under TP-8 with expert parallelism off:

* MLA with 64 / 8 = 8 heads; the low-rank projections (``q_lora_rank`` 1536, ``kv_lora_rank``
  512, rope 64) are replicated under TP, so they keep the full size here;
* all 384 routed experts, each at 2048 / 8 = 256 columns (TP shards every expert's
  intermediate width), top-8 routing; the shared expert and the dense first layer at 1/8;
* routed experts in INT4 compressed-tensors (pack-quantized, symmetric, group 32, as
  K2 Thinking / K2.6 ship) so SGLang takes its Marlin MoE path; everything else bf16;
* the LM head keeps the full 163,840-token vocabulary. Under TP-8 each rank holds 1/8 of it
  and the ranks all-gather the logits; a one-GPU server must sample from all of them, so this
  rank carries 7/8 x 163,840 x 7168 x 2 bytes = 2.06 GB of head weight the real rank does not
  hold, and its draft/verify head matmuls are 8x the real rank's (one dense GEMM: a few
  percent of a round at these shapes). The embedding is full as well (a lookup: no cost).

The drafter is a DFlash drafter of the published Kimi K2.5/K2.6 shape (z-lab/Kimi-K2.5-DFlash
config: 6 layers, hidden 7168, block 8, target layers 1, 12, 24, 35, 47, 58; its 6.48 GiB
bf16 checkpoint fits 64 heads x 128 with 8 KV heads and an 18,432-wide MLP, which is assumed),
sharded the same way: 8 heads, 1 KV head, MLP 2304; its ``fc`` over the six target layers is
replicated under TP, so it is full size.

The tokenizer is the trained pair's (4,096 ids): prompts are its ids, and ids above it that
the random model emits decode to nothing (the benchmark reads token ids, not text).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TP = 8
K26 = {
    "layers": 61,
    "hidden": 7168,
    "heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "routed_experts": 384,
    "experts_per_token": 8,
    "moe_intermediate": 2048,
    "dense_intermediate": 18432,
    "vocab": 163840,
}
# z-lab/Kimi-K2.5-DFlash (config.json as published); heads and MLP width inferred from its size.
DRAFTER = {
    "layers": 6,
    "block_size": 8,
    "target_layer_ids": [1, 12, 24, 35, 47, 58],
    "heads": 64,
    "kv_heads": 8,
    "head_dim": 128,
    "intermediate": 18432,
}
# Its RoPE as published: YaRN over a 4,096-token original window, and no `rope_is_neox_style`
# field, so SGLang takes Qwen3's neox style, the style its fused drafter paths serve (the
# prompt's context KV in one projection and one norm + RoPE kernel, the drafter's q/k norm +
# RoPE in one kernel); an interleaved drafter takes the per-layer paths.
DRAFTER_ROPE_SCALING = {
    "rope_type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
PAIR_TOKENIZER = Path(__file__).resolve().parent / "pairs" / "pycode-4l" / "target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MASK_TOKEN, MASK_TOKEN_ID = "<|MASK|>", 3  # the pair tokenizer's mask token
# Kimi-K2-Thinking's quantization_config (moonshotai/Kimi-K2-Thinking config.json): W4A16
# group 32 on the routed experts; attention, shared experts, dense MLPs and the head stay bf16.
QUANTIZATION = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    ],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "block_structure": None,
                "observer": "minmax",
                "observer_kwargs": {},
            },
        }
    },
}


def rank_config(layers: int = K26["layers"], quantized: bool = True, tp: int = TP) -> dict:
    """``config.json`` of one TP rank of Kimi K2.6 (``DeepseekV3ForCausalLM``)."""
    if not 2 <= layers <= K26["layers"]:
        raise ValueError(f"layers must be 2..{K26['layers']} (the first is dense), got {layers}")
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": K26["vocab"],
        "hidden_size": K26["hidden"],
        "intermediate_size": K26["dense_intermediate"] // tp,
        "moe_intermediate_size": K26["moe_intermediate"] // tp,
        "num_hidden_layers": layers,
        "num_attention_heads": K26["heads"] // tp,
        "num_key_value_heads": K26["heads"] // tp,
        "n_shared_experts": 1,
        "n_routed_experts": K26["routed_experts"],
        "num_experts_per_tok": K26["experts_per_token"],
        "routed_scaling_factor": 2.827,
        "q_lora_rank": K26["q_lora_rank"],
        "kv_lora_rank": K26["kv_lora_rank"],
        "qk_nope_head_dim": K26["qk_nope_head_dim"],
        "qk_rope_head_dim": K26["qk_rope_head_dim"],
        "v_head_dim": K26["v_head_dim"],
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "rope_type": "deepseek_yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    if quantized:
        config["quantization_config"] = QUANTIZATION
    return config


def drafter_config(target_layers: int = K26["layers"], tp: int = TP) -> dict:
    """``config.json`` of the matching DFlash drafter rank (target layer ids spread over a
    short target, so ``--layers N`` still has a drafter).

    SGLang takes tap ``i`` as the input of layer ``i + 1`` (``set_dflash_layers_to_capture``),
    so a tap must leave one layer after it: ``i <= layers - 2`` (the published 58 of 61 does).
    A tap on the last layer is never captured and the graph capture fails."""
    layer_ids = list(DRAFTER["target_layer_ids"])
    if target_layers < K26["layers"]:  # a short target: spread the taps over what it can capture
        last = target_layers - 2
        n = min(len(layer_ids), last + 1)
        layer_ids = sorted({round(i * last / max(n - 1, 1)) for i in range(n)})
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": K26["vocab"],
        "hidden_size": K26["hidden"],
        "intermediate_size": DRAFTER["intermediate"] // tp,
        "num_hidden_layers": DRAFTER["layers"],
        "num_attention_heads": DRAFTER["heads"] // tp,
        "num_key_value_heads": max(DRAFTER["kv_heads"] // tp, 1),
        "head_dim": DRAFTER["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "rope_scaling": DRAFTER_ROPE_SCALING,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "block_size": DRAFTER["block_size"],
        "num_target_layers": target_layers,
        "dflash_config": {
            "target_layer_ids": layer_ids,
            "mask_token": MASK_TOKEN,
            "mask_token_id": MASK_TOKEN_ID,
        },
    }


def _write_folder(folder: Path, config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    for name in TOKENIZER_FILES:
        if (PAIR_TOKENIZER / name).exists():
            shutil.copy(PAIR_TOKENIZER / name, folder / name)


def write_rank(out: Path, layers: int = K26["layers"], quantized: bool = True) -> dict[str, Path]:
    """Write ``out/target`` and ``out/drafter``; returns both paths."""
    out = Path(out)
    paths = {"target": out / "target", "drafter": out / "drafter"}
    _write_folder(paths["target"], rank_config(layers, quantized))
    _write_folder(paths["drafter"], drafter_config(layers))
    return paths


def weight_bytes(config: dict) -> dict[str, float]:
    """GB of weights the target rank holds (INT4 experts with bf16 group-32 scales)."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, qk = config["num_attention_heads"], config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    attn = (
        h * (config["q_lora_rank"] + config["kv_lora_rank"] + config["qk_rope_head_dim"])
        + config["q_lora_rank"] * heads * qk
        + config["kv_lora_rank"] * heads * (config["qk_nope_head_dim"] + config["v_head_dim"])
        + heads * config["v_head_dim"] * h
    ) * 2
    expert_params = config["n_routed_experts"] * 3 * h * config["moe_intermediate_size"]
    bytes_per_int4 = 0.5 + 2 / 32 if "quantization_config" in config else 2
    moe = expert_params * bytes_per_int4 + 3 * h * config["moe_intermediate_size"] * 2
    dense = 3 * h * config["intermediate_size"] * 2
    vocab = 2 * config["vocab_size"] * h * 2
    gb = 1e-9
    return {
        "attention_gb": attn * layers * gb,
        "moe_gb": moe * (layers - 1) * gb,
        "dense_gb": dense * gb,
        "embed_and_head_gb": vocab * gb,
        "total_gb": (attn * layers + moe * (layers - 1) + dense + vocab) * gb,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=K26["layers"], help="a short version for quick tests")
    parser.add_argument("--no-quant", action="store_true", help="bf16 experts (no compressed-tensors)")
    args = parser.parse_args(argv)
    paths = write_rank(args.out, args.layers, not args.no_quant)
    sizes = weight_bytes(rank_config(args.layers, not args.no_quant))
    print(json.dumps({k: str(v) for k, v in paths.items()} | {k: round(v, 2) for k, v in sizes.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
