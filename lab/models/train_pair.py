"""Train a small target + DFlash drafter pair on real text, so that acceptance can
be measured rather than assumed.

1. **corpus** - the Python source of the installed packages (``site-packages``):
   de-duplicated by content, a fixed share of *files* held out;
2. **tokenizer** - byte-level BPE (a few thousand tokens, ``<|endoftext|>`` and
   ``<|MASK|>`` among the special tokens), saved as ``PreTrainedTokenizerFast``;
3. **target** - a Qwen3-style causal LM, trained on the corpus;
4. **drafter** - a DFlash block drafter trained against the frozen target: for
   random anchor positions ``a`` the block ``[x_a, MASK x (block-1)]`` attends to
   the projected target features of ``x_<a`` and bidirectionally within itself,
   and its hidden states through the target's LM head predict ``x_a+1 ..
   x_a+block-1``. Half of its sequences are the target's own continuations
   (greedy and sampled) of corpus prompts, as DFlash trains on target outputs.

The model code (``pair_modules.py``) is plain torch and mirrors what SGLang serves; the
corpus and tokenizer steps are in ``pair_corpus.py``. The learned mask embedding is written into
the target's embedding row of ``<|MASK|>`` (a token the target never sees).

Output: ``OUT/{target,drafter}`` in the folder conventions of ``models/tiny.py``
(bf16 safetensors), ``manifest.json``, ``train_log.txt``, ``heldout_prompts.json``.

    python -m lab.models.train_pair [--device cuda|cpu] [--out DIR] [--data DIR]

``--data`` caches the prepared corpus (tokenizer and token arrays); a run that
finds it there skips the corpus and tokenizer steps, so the data can be prepared
on one machine (``--prepare-only``) and the models trained on another.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lab.models.pair_corpus import EOS_TOKEN, default_site_packages, prepare_data
from lab.models.pair_export import _bf16_roundtrip, export_pair, manifest
from lab.models.pair_modules import Drafter, PairSpec, Target, draft_step_loss, init_weights, sample_anchors
from lab.models.tiny import MASK_TOKEN
from lab.models.train_loop import Log, autocast_factory, train_loop

DEFAULT_OUT = Path(__file__).resolve().parent / "pairs" / "pycode-4l"


SMOKE = dict(
    corpus_bytes=1_500_000,
    tokenizer_bytes=600_000,
    vocab_size=1024,
    hidden=64,
    head_dim=16,
    intermediate=128,
    draft_layers=1,
    target_steps=30,
    target_batch=8,
    target_seq=128,
    gen_sequences=32,
    gen_prompt=48,
    gen_new=32,
    draft_steps=30,
    draft_batch=8,
    draft_anchors=6,
    heldout_prompts=8,
    prompt_tokens=32,
    eval_new_tokens=24,
)


# --------------------------------------------------------------------------- training


def random_windows(stream: np.ndarray, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.size - length, (n,), generator=gen).numpy()
    return torch.from_numpy(np.stack([stream[s : s + length] for s in starts]).astype(np.int64))


def train_target(target, train, spec, device, log, seconds, gen) -> dict:
    autocast = autocast_factory(device)

    def batch_loss():
        seqs = random_windows(train, spec.target_batch, spec.target_seq + 1, gen).to(device)
        with autocast():
            hidden, _ = target(seqs[:, :-1])
            logits = target.logits(hidden).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1))
        return loss, lambda: ""

    return train_loop(target, "target", spec.target_lr, spec.target_steps, seconds, device, log, batch_loss)


@torch.no_grad()
def target_heldout_loss(target, heldout, spec, device, gen, batches=16) -> float:
    autocast = autocast_factory(device)
    losses = []
    for _ in range(batches):
        seqs = random_windows(heldout, spec.target_batch, spec.target_seq + 1, gen).to(device)
        with autocast():
            hidden, _ = target(seqs[:, :-1])
            logits = target.logits(hidden).float()
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1)).item())
    return float(np.mean(losses))


@torch.no_grad()
def generate(target, prompts: torch.Tensor, new: int, greedy: torch.Tensor, gen: torch.Generator, device):
    """Continue ``prompts`` [N, P] by ``new`` tokens: greedy rows take the argmax,
    the others sample at T=1. The sampling draws come from ``gen`` (on the CPU)."""
    autocast = autocast_factory(device)
    n, p = prompts.shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = target.new_cache(n, p + new, dtype, device)
    seqs = torch.empty((n, p + new), dtype=torch.int64, device=device)
    seqs[:, :p] = prompts
    ids, start = prompts, 0
    greedy = greedy.to(device)
    for t in range(new):
        with autocast():
            hidden, _ = target(ids, cache=cache, start=start)
            logits = target.logits(hidden[:, -1]).float()
        uniform = torch.rand(n, generator=gen).to(device)
        cdf = logits.softmax(-1).cumsum(-1)
        sampled = (cdf < uniform[:, None]).sum(-1).clamp_max(logits.shape[-1] - 1)
        nxt = torch.where(greedy, logits.argmax(-1), sampled)
        seqs[:, p + t] = nxt
        start += ids.shape[1]
        ids = nxt[:, None]
    return seqs


def target_continuations(target, train, spec, device, log, gen) -> torch.Tensor:
    chunks, batch = [], 1024
    started = time.perf_counter()
    for i in range(0, spec.gen_sequences, batch):
        n = min(batch, spec.gen_sequences - i)
        prompts = random_windows(train, n, spec.gen_prompt, gen).to(device)
        greedy = (torch.arange(n) * spec.gen_greedy_share) % 1 < spec.gen_greedy_share  # 0.5: every other
        chunks.append(generate(target, prompts, spec.gen_new, greedy, gen, device).cpu())
    out = torch.cat(chunks)
    log(f"continuations: {out.shape[0]} x {out.shape[1]} tokens in {time.perf_counter() - started:.0f}s")
    return out


def draft_batch(train, generated, spec, gen):
    """Corpus windows (anchors anywhere) and target continuations (anchors in the generated
    part), ``draft_gen_share`` of the batch (half by default)."""
    n_gen = round(spec.draft_batch * spec.draft_gen_share)
    n_corpus = spec.draft_batch - n_gen
    length, block = spec.draft_seq, spec.block_size
    rows = torch.randint(0, generated.shape[0], (n_gen,), generator=gen)
    corpus = random_windows(train, n_corpus, length, gen) if n_corpus else generated[:0]
    seqs = torch.cat((corpus, generated[rows]))
    low = torch.cat((torch.ones(n_corpus, dtype=torch.int64), torch.full((n_gen,), spec.gen_prompt)))
    anchors = sample_anchors(spec.draft_batch, spec.draft_anchors, low, length - block, gen)
    return seqs, anchors


def train_drafter(target, drafter, train, generated, spec, mask_id, device, log, seconds, gen) -> dict:
    for p in target.parameters():
        p.requires_grad_(False)
    autocast = autocast_factory(device)

    def batch_loss():
        seqs, anchors = draft_batch(train, generated, spec, gen)
        loss, hard, acc, _ = draft_step_loss(
            target, drafter, seqs.to(device), anchors.to(device), spec, mask_id, autocast
        )
        return loss, lambda: f"top-1@depth {' '.join(f'{a:.2f}' for a in acc.tolist())} "

    return train_loop(drafter, "drafter", spec.draft_lr, spec.draft_steps, seconds, device, log, batch_loss)


# --------------------------------------------------------------------------- evaluation


def heldout_prompt_set(heldout: np.ndarray, offsets: np.ndarray, tok, spec: PairSpec, gen) -> list[dict]:
    """Prompts cut from held-out files: ``prompt_tokens`` tokens starting at a line
    start somewhere inside a file (one prompt per file)."""
    ends = np.append(offsets[1:], heldout.size)
    newline = {i for i in range(len(tok)) if tok.convert_ids_to_tokens(i).endswith("Ċ")}  # ends a line
    order = torch.randperm(len(offsets), generator=gen).tolist()
    prompts = []
    for doc in order:
        start, end = int(offsets[doc]), int(ends[doc]) - 1
        need = spec.prompt_tokens + spec.eval_new_tokens
        if end - start < need + 16:
            continue
        lo = start + int(torch.randint(0, end - start - need, (1,), generator=gen))
        cut = next((i + 1 for i in range(lo, end - need) if int(heldout[i]) in newline), None)
        if cut is None:
            continue
        ids = heldout[cut : cut + spec.prompt_tokens].astype(np.int64).tolist()
        prompts.append({"doc": doc, "input_ids": ids, "text": tok.decode(ids)})
        if len(prompts) == spec.heldout_prompts:
            break
    return prompts


@torch.no_grad()
def evaluate_pair(target, drafter, heldout, prompts, spec, mask_id, device, gen) -> dict:
    """Held-out drafter loss on corpus windows, and on the target's greedy
    continuations of the held-out prompts: per-depth top-1 agreement and the chain's
    expected accepted drafts (consecutive agreements from depth 1) per anchor."""
    autocast = autocast_factory(device)
    block = spec.block_size
    n = 32
    seqs = random_windows(heldout, n, spec.draft_seq, gen)
    anchors = sample_anchors(
        n, spec.draft_anchors, torch.ones(n, dtype=torch.int64), spec.draft_seq - block, gen
    )
    loss, hard, acc, _ = draft_step_loss(
        target, drafter, seqs.to(device), anchors.to(device), spec, mask_id, autocast, soft_weight=0.0
    )
    ids = torch.tensor([p["input_ids"] for p in prompts], dtype=torch.int64, device=device)
    greedy = generate(
        target, ids, spec.eval_new_tokens, torch.ones(len(prompts), dtype=torch.bool), gen, device
    )
    p, length = ids.shape[1], greedy.shape[1]
    anchors = torch.arange(p, length - block + 1, device=device)[None].expand(len(prompts), -1)
    _, _, g_acc, logits = draft_step_loss(
        target, drafter, greedy, anchors, spec, mask_id, autocast, soft_weight=0.0
    )
    pos = anchors[:, :, None] + torch.arange(1, block, device=device)
    match = logits.argmax(-1) == greedy.gather(1, pos.reshape(len(prompts), -1)).view_as(pos)
    accepted = match.int().cumprod(-1).sum(-1).float()
    return {
        "heldout_corpus_loss": float(loss.item()),
        "heldout_corpus_ce_per_depth": [round(x, 4) for x in hard.tolist()],
        "heldout_corpus_top1_per_depth": [round(x, 4) for x in acc.tolist()],
        "greedy_top1_per_depth": [round(x, 4) for x in g_acc.tolist()],
        "greedy_chain_accepted_per_anchor": round(float(accepted.mean()), 4),
        "greedy_chain_tokens_per_round_estimate": round(1.0 + float(accepted.mean()), 4),
    }


# --------------------------------------------------------------------------- main


def run(
    spec: PairSpec, out: Path, data: Path, site_packages: Path, device: torch.device, time_limit_s: float
) -> dict:
    from transformers import AutoTokenizer

    log = Log()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    torch.manual_seed(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    prepare_data(data, spec, site_packages, log)
    tok = AutoTokenizer.from_pretrained(data / "tokenizer")
    vocab, mask_id, eos = (
        len(tok),
        tok.convert_tokens_to_ids(MASK_TOKEN),
        tok.convert_tokens_to_ids(EOS_TOKEN),
    )
    assert eos == 0, "the configs say eos_token_id 0"
    train = np.load(data / "train.npy")
    heldout = np.load(data / "heldout.npy")
    offsets = np.load(data / "heldout_offsets.npy")
    corpus = json.loads((data / "DONE.json").read_text())["corpus"]
    log(f"device {device}, vocab {vocab}, {train.size} train tokens, spec {json.dumps(asdict(spec))}")

    target, drafter = _new_pair(spec, vocab, device)
    deadline = time.perf_counter() + time_limit_s
    target_stats = _target_phase(target, train, heldout, spec, device, log, 0.5 * time_limit_s, gen)
    t0 = time.perf_counter()
    generated = target_continuations(target, train, spec, device, log, gen)
    seconds = deadline - time.perf_counter() - 0.05 * time_limit_s  # the rest: evaluation and export
    draft_stats = train_drafter(target, drafter, train, generated, spec, mask_id, device, log, seconds, gen)
    _bf16_roundtrip(drafter)
    draft_stats["seconds"] = round(time.perf_counter() - t0, 1)
    prompts = heldout_prompt_set(heldout, offsets, tok, spec, torch.Generator().manual_seed(spec.seed + 2))
    draft_stats.update(
        evaluate_pair(
            target, drafter, heldout, prompts, spec, mask_id, device, torch.Generator().manual_seed(3)
        )
    )
    log(f"drafter: {json.dumps(draft_stats)}")

    out.mkdir(parents=True, exist_ok=True)
    export_pair(out, target, drafter, data / "tokenizer", spec, vocab, mask_id)
    heldout_paths = json.loads((data / "heldout_paths.json").read_text())
    for p in prompts:
        p["file"] = heldout_paths[p.pop("doc")]
    (out / "heldout_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    facts = {"started_at": started_at, "device": device, "corpus": corpus, "target": target_stats,
             "drafter": draft_stats, "heldout_prompts": len(prompts),
             "seconds_total": round(time.perf_counter() - log.start, 1)}  # fmt: skip
    record = manifest(out, spec, target, drafter, vocab, mask_id, facts)
    (out / "manifest.json").write_text(json.dumps(record, indent=1) + "\n")
    sizes = record["sizes"]
    log(
        f"wrote {out} (target {sizes['target_params'] / 1e6:.2f}M, "
        f"drafter {sizes['drafter_params'] / 1e6:.2f}M params)"
    )
    (out / "train_log.txt").write_text("\n".join(log.lines) + "\n")
    return record


def _new_pair(spec: PairSpec, vocab: int, device: torch.device) -> tuple[Target, Drafter]:
    """Both models, initialised on the CPU from one seeded generator (the same on every device)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    target = Target(spec, vocab).to(device)
    drafter = Drafter(spec).to(device)
    init_gen = torch.Generator().manual_seed(spec.seed + 1)
    for module, layers in ((target, spec.layers), (drafter, spec.draft_layers)):
        module.cpu()
        init_weights(module, layers, init_gen)
        module.to(device)
    return target, drafter


def _target_phase(target, train, heldout, spec, device, log, seconds, gen) -> dict:
    """Train the target, round it to bf16 as it is exported, and measure its held-out loss."""
    t0 = time.perf_counter()
    target_stats = train_target(target, train, spec, device, log, seconds, gen)
    _bf16_roundtrip(target)
    target_stats["heldout_loss"] = target_heldout_loss(
        target, heldout, spec, device, torch.Generator().manual_seed(1)
    )
    target_stats["seconds"] = round(time.perf_counter() - t0, 1)
    log(f"target: {json.dumps(target_stats)}")
    return target_stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"pair folder (default: {DEFAULT_OUT})")
    parser.add_argument(
        "--data", type=Path, default=None, help="prepared-data cache (default: in the cache dir)"
    )
    parser.add_argument(
        "--site-packages", type=Path, default=None, help="corpus root (default: this Python's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=None)
    parser.add_argument("--draft-steps", type=int, default=None)
    parser.add_argument("--time-limit", type=float, default=30.0, help="minutes for both training phases")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and a few steps (a plumbing check)")
    parser.add_argument("--prepare-only", action="store_true", help="only build the --data cache")
    args = parser.parse_args(argv)

    spec = PairSpec(seed=args.seed)
    if args.smoke:
        spec = replace(spec, **SMOKE)
    overrides = {
        k: v for k, v in (("target_steps", args.target_steps), ("draft_steps", args.draft_steps)) if v
    }
    spec = replace(spec, **overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    from sglang_ddtree.config import cache_root

    data = args.data or cache_root() / "pair-data" / ("smoke" if args.smoke else "full")
    site = args.site_packages or default_site_packages()
    if args.prepare_only:
        prepare_data(data, spec, site, Log())
        return
    run(spec, args.out, data, site, torch.device(args.device), args.time_limit * 60)


if __name__ == "__main__":
    main()
