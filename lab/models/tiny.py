"""Tiny models that need no download: a tokenizer, a Qwen3-style target and a
DFlash drafter, deterministic from a seed and cached on disk.

They exist so that the real SGLang server can run end to end on a CPU in
seconds: tests, the demo and the A/B smoke run all use them. Weights are random
(a random drafter is almost never right; tests that need accepted drafts control
the drafter, see ``tests/oracle_plugin.py``).

    python -m lab.models.tiny [--out DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

MASK_TOKEN = "<|MASK|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]
BUILD_VERSION = 2  # bump when the recipe changes, so caches rebuild

_CORPUS = """\
The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens
cheaply and verifies them with the target model in one forward pass. A draft tree
holds many candidate continuations; the target checks all of them at once.
def add(a, b):
    return a + b
for i in range(10):
    print(i, i * i)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Letters: a b c d e f g h i j k l m n o p.
"""


@dataclass(frozen=True)
class TinySpec:
    """Sizes of a tiny target/drafter pair (defaults: what CPU tests use)."""

    seed: int = 0
    vocab_merges: int = 300
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    draft_layers: int = 1
    block_size: int = 8
    target_layer_ids: tuple[int, ...] = (0, 2)
    max_position: int = 4096
    # "qwen3", or "deepseek_v3": the family SGLang serves Kimi K2.x with (MLA attention
    # with a latent KV, MoE with a shared expert, first layer dense)
    arch: str = "qwen3"
    kv_lora_rank: int = 32
    qk_rope_head_dim: int = 8
    qk_nope_head_dim: int = 16
    v_head_dim: int = 16
    routed_experts: int = 8
    experts_per_token: int = 2
    moe_intermediate: int = 32

    def key(self) -> str:
        blob = json.dumps({"v": BUILD_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class TinyModels:
    target: Path
    drafter: Path
    vocab_size: int
    mask_token_id: int
    spec: TinySpec


def default_cache_dir() -> Path:
    from sglang_ddtree.config import cache_root

    return cache_root() / "tiny-models"


def build_tiny_models(spec: TinySpec = TinySpec(), cache_dir: Path | None = None) -> TinyModels:
    """Build (or reuse from the cache) the tokenizer, target and drafter folders."""
    root = Path(cache_dir or default_cache_dir()) / spec.key()
    target, drafter = root / "target", root / "drafter"
    done = root / "DONE.json"
    if not done.exists():
        tmp = root.with_name(root.name + f".tmp{os.getpid()}")
        _write_tokenizer(tmp / "target", spec)
        vocab_size, mask_id = _tokenizer_sizes(tmp / "target")
        _write_target(tmp / "target", spec, vocab_size)
        _write_drafter(tmp / "drafter", spec, vocab_size, mask_id)
        (tmp / "DONE.json").write_text(json.dumps({"vocab_size": vocab_size, "mask_token_id": mask_id}))
        try:
            tmp.rename(root)
        except OSError:  # another process won the race; its copy is identical
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    meta = json.loads(done.read_text())
    return TinyModels(target, drafter, meta["vocab_size"], meta["mask_token_id"], spec)


def _write_tokenizer(folder: Path, spec: TinySpec) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + spec.vocab_merges,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", MASK_TOKEN],
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)


def _tokenizer_sizes(folder: Path) -> tuple[int, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return len(tok), tok.convert_tokens_to_ids(MASK_TOKEN)


def _qwen3_config(spec: TinySpec, vocab_size: int, layers: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 0,
    }


def _layer_weights(gen: torch.Generator, spec: TinySpec, prefix: str) -> dict[str, torch.Tensor]:
    h, q, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim

    def rand(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=gen) * scale

    return {
        f"{prefix}.input_layernorm.weight": torch.ones(h),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h),
        f"{prefix}.self_attn.q_proj.weight": rand(q, h),
        f"{prefix}.self_attn.k_proj.weight": rand(kv, h),
        f"{prefix}.self_attn.v_proj.weight": rand(kv, h),
        f"{prefix}.self_attn.o_proj.weight": rand(h, q),
        f"{prefix}.self_attn.q_norm.weight": torch.ones(spec.head_dim),
        f"{prefix}.self_attn.k_norm.weight": torch.ones(spec.head_dim),
        f"{prefix}.mlp.gate_proj.weight": rand(spec.intermediate, h),
        f"{prefix}.mlp.up_proj.weight": rand(spec.intermediate, h),
        f"{prefix}.mlp.down_proj.weight": rand(h, spec.intermediate),
    }


def _save(folder: Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, folder / "model.safetensors"
    )


def _deepseek_config(spec: TinySpec, vocab_size: int) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "moe_intermediate_size": spec.moe_intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.heads,
        "n_shared_experts": 1,
        "n_routed_experts": spec.routed_experts,
        "num_experts_per_tok": spec.experts_per_token,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": spec.kv_lora_rank,
        "q_lora_rank": None,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        # Kimi K2.x runs YaRN-scaled rope; factor 1 keeps it plain at these lengths
        "rope_scaling": {
            "type": "yarn",
            "rope_type": "deepseek_yarn",
            "factor": 1.0,
            "original_max_position_embeddings": spec.max_position,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 0,
    }


def _deepseek_layer_weights(gen: torch.Generator, spec: TinySpec, i: int) -> dict[str, torch.Tensor]:
    h, heads = spec.hidden, spec.heads
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    prefix = f"model.layers.{i}"

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

    weights = {
        f"{prefix}.input_layernorm.weight": torch.ones(h),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h),
        f"{prefix}.self_attn.q_proj.weight": rand(heads * qk, h),
        f"{prefix}.self_attn.kv_a_proj_with_mqa.weight": rand(spec.kv_lora_rank + spec.qk_rope_head_dim, h),
        f"{prefix}.self_attn.kv_a_layernorm.weight": torch.ones(spec.kv_lora_rank),
        f"{prefix}.self_attn.kv_b_proj.weight": rand(
            heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank
        ),
        f"{prefix}.self_attn.o_proj.weight": rand(h, heads * spec.v_head_dim),
    }

    def mlp(name: str, inner: int):
        return {
            f"{name}.gate_proj.weight": rand(inner, h),
            f"{name}.up_proj.weight": rand(inner, h),
            f"{name}.down_proj.weight": rand(h, inner),
        }

    if i == 0:  # first_k_dense_replace = 1
        weights.update(mlp(f"{prefix}.mlp", spec.intermediate))
        return weights
    weights[f"{prefix}.mlp.gate.weight"] = rand(spec.routed_experts, h)
    weights[f"{prefix}.mlp.gate.e_score_correction_bias"] = torch.zeros(spec.routed_experts)
    weights.update(mlp(f"{prefix}.mlp.shared_experts", spec.moe_intermediate))
    for e in range(spec.routed_experts):
        weights.update(mlp(f"{prefix}.mlp.experts.{e}", spec.moe_intermediate))
    return weights


def _write_target(folder: Path, spec: TinySpec, vocab_size: int) -> None:
    gen = torch.Generator().manual_seed(spec.seed)
    if spec.arch == "deepseek_v3":
        weights = {
            "model.embed_tokens.weight": torch.randn(vocab_size, spec.hidden, generator=gen),
            "model.norm.weight": torch.ones(spec.hidden),
            "lm_head.weight": torch.randn(vocab_size, spec.hidden, generator=gen) * 0.5,
        }
        for i in range(spec.layers):
            weights.update(_deepseek_layer_weights(gen, spec, i))
        _save(folder, _deepseek_config(spec, vocab_size), weights)
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
        return
    weights = {
        "model.embed_tokens.weight": torch.randn(vocab_size, spec.hidden, generator=gen),
        "model.norm.weight": torch.ones(spec.hidden),
        # A scaled head gives peaked, context-dependent next-token distributions.
        "lm_head.weight": torch.randn(vocab_size, spec.hidden, generator=gen) * 0.5,
    }
    for i in range(spec.layers):
        weights.update(_layer_weights(gen, spec, f"model.layers.{i}"))
    config = _qwen3_config(spec, vocab_size, spec.layers)
    _save(folder, config, weights)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))


def _write_drafter(folder: Path, spec: TinySpec, vocab_size: int, mask_id: int) -> None:
    gen = torch.Generator().manual_seed(spec.seed + 1)
    n_ctx = len(spec.target_layer_ids)
    weights = {
        "norm.weight": torch.ones(spec.hidden),
        "hidden_norm.weight": torch.ones(spec.hidden),
        "fc.weight": torch.randn(spec.hidden, n_ctx * spec.hidden, generator=gen)
        * (n_ctx * spec.hidden) ** -0.5,
    }
    for i in range(spec.draft_layers):
        weights.update(_layer_weights(gen, spec, f"layers.{i}"))
    _save(folder, drafter_config(spec, vocab_size, mask_id), weights)


def drafter_config(spec: TinySpec, vocab_size: int, mask_id: int) -> dict:
    """The ``config.json`` of a DFlash drafter SGLang's ``DFlashDraftModel`` loads."""
    config = _qwen3_config(spec, vocab_size, spec.draft_layers)
    config.update(
        {
            "architectures": ["DFlashDraftModel"],
            "block_size": spec.block_size,
            "num_target_layers": spec.layers,
            # Without this the bf16 draft attention takes a Triton-only rope kernel.
            "rope_is_neox_style": False,
            "dflash_config": {
                "target_layer_ids": list(spec.target_layer_ids),
                "mask_token": MASK_TOKEN,
                "mask_token_id": mask_id,
            },
        }
    )
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="cache folder (default: ~/.cache/sglang-ddtree)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=TinySpec.block_size)
    parser.add_argument("--arch", choices=["qwen3", "deepseek_v3"], default="qwen3")
    args = parser.parse_args(argv)
    models = build_tiny_models(TinySpec(seed=args.seed, block_size=args.block_size, arch=args.arch), args.out)
    print(
        json.dumps(
            {"target": str(models.target), "drafter": str(models.drafter), "vocab_size": models.vocab_size}
        )
    )


if __name__ == "__main__":
    main()
