"""Train another DFlash drafter for a trained pair's target, the target frozen and unchanged: a
drafter more confident than the pair's own (deeper, reading more target layers, trained longer
and on the target's greedy continuations), to record a real drafter's draws at the confidence
of Kimi's (chain accept length about 5) rather than the pair's (about 2.4).

    python -m lab.models.train_drafter --pair lab/models/pairs/pycode-4l --name drafter-d4 \\
        [--draft-layers 4] [--target-layer-ids 0,1,2] [--greedy-share 1.0] [--gen-share 1.0] \\
        [--gen-sequences 32768] [--draft-steps N] [--time-limit MINUTES] [--data DIR] [--device cuda]

The corpus is cut as the pair's was, from this Python's packages, and encoded by the pair's own
tokenizer (``--data``: where it is prepared, or was, e.g. on another machine). The drafter's mask embedding is the target's ``<|MASK|>`` row, frozen, so the
pair's target folder serves the new drafter as it is. Writes ``PAIR/NAME/`` (``config.json``,
``model.safetensors``: what ``--speculative-draft-model-path`` takes) with ``manifest.json``
(sizes, training, and the chain's estimated tokens per round on the pair's held-out prompts,
from the target's greedy continuations) and ``train_log.txt``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from lab.models.pair_corpus import default_site_packages, prepare_data
from lab.models.pair_export import _bf16_roundtrip, _save_folder, count_params
from lab.models.pair_modules import Drafter, PairSpec, Target, init_weights
from lab.models.tiny import drafter_config
from lab.models.train_loop import Log
from lab.models.train_pair import evaluate_pair, target_continuations, train_drafter
from sglang_ddtree.ab.stamp import git_commit


def load_target(pair: Path, device: torch.device) -> tuple[PairSpec, Target, int, int]:
    """The pair's spec, its target (float32, as exported), vocabulary size and mask token id."""
    from safetensors.torch import load_file

    record = json.loads((pair / "manifest.json").read_text())
    fields = dict(record["spec"])
    fields["target_layer_ids"] = tuple(fields["target_layer_ids"])
    spec = PairSpec(**fields)
    vocab, mask_id = int(record["tokenizer"]["vocab_size"]), int(record["tokenizer"]["mask_token_id"])
    target = Target(spec, vocab)
    weights = load_file(pair / "target" / "model.safetensors")
    target.load_state_dict({k: v.float() for k, v in weights.items()})
    return spec, target.to(device), vocab, mask_id


def check_same_tokenizer(data: Path, pair: Path) -> None:
    """The prepared corpus must be tokenized as the pair's target reads it."""
    ours, theirs = data / "tokenizer" / "tokenizer.json", pair / "target" / "tokenizer.json"
    if ours.read_bytes() != theirs.read_bytes():
        raise SystemExit(f"{ours} is not the pair's tokenizer ({theirs}): prepare the pair's corpus")


def new_drafter(spec: PairSpec, target: Target, mask_id: int, device: torch.device) -> Drafter:
    """A freshly initialised drafter whose mask embedding is the target's ``<|MASK|>`` row, frozen."""
    drafter = Drafter(spec)
    init_weights(drafter, spec.draft_layers, torch.Generator().manual_seed(spec.seed + 1))
    with torch.no_grad():
        drafter.mask_embedding.copy_(target.model.embed_tokens.weight[mask_id].cpu())
    drafter.mask_embedding.requires_grad_(False)
    return drafter.to(device)


def save_drafter(out: Path, drafter, spec, vocab, mask_id, stats, log, args, argv, started_at) -> None:
    """The drafter folder (bf16 weights without the mask embedding: the target's row serves it),
    its manifest and its training log."""
    weights = {k: v for k, v in drafter.state_dict().items() if k != "mask_embedding"}
    _save_folder(out, drafter_config(spec.tiny_spec(), vocab, mask_id), weights)
    record = {
        "name": args.name,
        "pair": args.pair.name,
        "created_utc": started_at,
        "commit": git_commit(),
        "command": "python -m lab.models.train_drafter " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "spec": asdict(spec),
        "drafter_params": count_params(weights.values()),
        "drafter": stats,
        "seconds_total": round(time.perf_counter() - log.start, 1),
    }
    (out / "manifest.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "train_log.txt").write_text("\n".join(log.lines) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", type=Path, required=True, help="the trained pair's folder")
    p.add_argument("--name", required=True, help="the new drafter's folder inside the pair")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data", type=Path, default=None, help="prepared-data cache (default: in the cache dir)")
    p.add_argument("--draft-layers", type=int, default=4)
    p.add_argument(
        "--target-layer-ids",
        default="0,1,2",
        help="target layers the drafter reads (not the last: SGLang taps layer k at layer k + 1's input)",
    )
    p.add_argument("--greedy-share", type=float, default=1.0, help="greedy share of the continuations")
    p.add_argument("--gen-share", type=float, default=1.0, help="continuations' share of a batch")
    p.add_argument("--gen-sequences", type=int, default=32768)
    p.add_argument("--draft-steps", type=int, default=20000, help="at most: --time-limit can cap them")
    p.add_argument("--draft-batch", type=int, default=None, help="sequences per step (default: the pair's)")
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts evaluated (default: all)")
    p.add_argument("--time-limit", type=float, default=8.0, help="minutes for continuations and training")
    p.add_argument("--prepare-only", action="store_true", help="only prepare --data (to carry it elsewhere)")
    args = p.parse_args(argv)
    for name, share in (("--greedy-share", args.greedy_share), ("--gen-share", args.gen_share)):
        if not 0.0 <= share <= 1.0:
            p.error(f"{name} must lie in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from sglang_ddtree.config import cache_root

    device, log = torch.device(args.device), Log()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    pair_spec, target, vocab, mask_id = load_target(args.pair, device)
    layers = tuple(int(x) for x in args.target_layer_ids.split(","))
    if not all(0 <= i < pair_spec.layers - 1 for i in layers):
        # SGLang captures layer k's output as layer k + 1's input, so a server has no tap after
        # the last layer: a drafter reading it trains here and fails at its first served round
        raise SystemExit(
            f"error: --target-layer-ids: a served drafter can read layers 0..{pair_spec.layers - 2} "
            f"of the target's {pair_spec.layers} (SGLang has no tap after the last)"
        )
    spec = replace(
        pair_spec,
        draft_layers=args.draft_layers,
        target_layer_ids=layers,
        gen_greedy_share=args.greedy_share,
        draft_gen_share=args.gen_share,
        gen_sequences=args.gen_sequences,
        draft_steps=args.draft_steps,
        draft_batch=args.draft_batch or pair_spec.draft_batch,
    )
    data = args.data or cache_root() / "pair-data" / args.pair.name
    prepare_data(data, pair_spec, default_site_packages(), log, tokenizer_from=args.pair / "target")
    check_same_tokenizer(data, args.pair)
    if args.prepare_only:
        return 0
    train, heldout = np.load(data / "train.npy"), np.load(data / "heldout.npy")
    torch.manual_seed(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed + 7)
    drafter = new_drafter(spec, target, mask_id, device)
    deadline = time.perf_counter() + args.time_limit * 60
    generated = target_continuations(target, train, spec, device, log, gen)
    seconds = deadline - time.perf_counter() - 0.05 * args.time_limit * 60  # the rest: evaluation
    stats = train_drafter(target, drafter, train, generated, spec, mask_id, device, log, seconds, gen)
    _bf16_roundtrip(drafter)
    prompts = json.loads((args.pair / "heldout_prompts.json").read_text())[: args.eval_prompts]
    stats.update(
        evaluate_pair(
            target, drafter, heldout, prompts, spec, mask_id, device, torch.Generator().manual_seed(3)
        )
    )
    log(f"drafter: {json.dumps(stats)}")
    out = args.pair / args.name
    save_drafter(out, drafter, spec, vocab, mask_id, stats, log, args, argv, started_at)
    print(f"wrote {out}: chain tokens per round (estimate) {stats['greedy_chain_tokens_per_round_estimate']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
