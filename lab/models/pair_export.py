"""A trained pair written out: the target and drafter folders in the conventions of
``models/tiny.py`` (bf16 safetensors), and the manifest that records how they were made."""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from lab.models.pair_corpus import EOS_TOKEN
from lab.models.pair_modules import Drafter, PairSpec, Target
from lab.models.tiny import MASK_TOKEN, _qwen3_config, drafter_config


def _bf16_roundtrip(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def _save_folder(folder: Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {k: v.detach().cpu().to(torch.bfloat16).contiguous() for k, v in weights.items()},
        folder / "model.safetensors",
    )


def export_pair(
    out: Path, target: Target, drafter: Drafter, tok_dir: Path, spec: PairSpec, vocab: int, mask_id: int
):
    tiny = spec.tiny_spec()
    with torch.no_grad():
        target.model.embed_tokens.weight[mask_id] = drafter.mask_embedding
    tgt_weights = {k: v for k, v in target.state_dict().items()}
    _save_folder(out / "target", _qwen3_config(tiny, vocab, spec.layers), tgt_weights)
    for name in os.listdir(tok_dir):
        shutil.copy(tok_dir / name, out / "target" / name)
    (out / "target" / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    config = drafter_config(tiny, vocab, mask_id)
    dr_weights = {k: v for k, v in drafter.state_dict().items() if k != "mask_embedding"}
    _save_folder(out / "drafter", config, dr_weights)


def count_params(weights) -> int:
    return int(sum(v.numel() for v in weights))


def manifest(out: Path, spec: PairSpec, target, drafter, vocab: int, mask_id: int, facts: dict) -> dict:
    """What a pair is and how it was made; ``facts`` carries the run's own records (start
    time, corpus, per-phase statistics, prompt count, total seconds)."""
    return {
        "name": out.name,
        "created_utc": facts["started_at"],
        "command": "python -m lab.models.train_pair " + " ".join(sys.argv[1:]),
        "machine": {
            "device": torch.cuda.get_device_name(facts["device"])
            if facts["device"].type == "cuda"
            else platform.processor() or "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "seed": spec.seed,
        "spec": asdict(spec),
        "corpus": facts["corpus"],
        "tokenizer": {
            "vocab_size": vocab,
            "mask_token": MASK_TOKEN,
            "mask_token_id": mask_id,
            "eos_token": EOS_TOKEN,
        },
        "sizes": {
            "target_params": count_params(target.state_dict().values()),
            "drafter_params": count_params(
                v for k, v in drafter.state_dict().items() if k != "mask_embedding"
            ),
            "target_bytes": (out / "target" / "model.safetensors").stat().st_size,
            "drafter_bytes": (out / "drafter" / "model.safetensors").stat().st_size,
            "dtype": "bfloat16",
        },
        "target": facts["target"],
        "drafter": facts["drafter"],
        "losses_after_bf16_rounding": True,
        "heldout_prompts": facts["heldout_prompts"],
        "seconds_total": facts["seconds_total"],
    }
