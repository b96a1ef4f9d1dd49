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

The model code here is plain torch and mirrors what SGLang serves: the target is
HF/SGLang Qwen3 (neox rope), the drafter is SGLang's ``DFlashDraftModel``
(context K/V from ``hidden_norm(fc(features))`` with no input norm, interleaved
rope since the config says ``rope_is_neox_style: false``, non-causal attention),
and the features for ``target_layer_ids`` k are the outputs of target layer k
(SGLang captures "before layer k+1"). The learned mask embedding is written into
the target's embedding row of ``<|MASK|>`` (a token the target never sees).

Output: ``OUT/{target,drafter}`` in the folder conventions of ``models/tiny.py``
(bf16 safetensors), ``manifest.json``, ``train_log.txt``, ``heldout_prompts.json``.

    python -m sglang_ddtree.models.train_pair [--device cuda|cpu] [--out DIR] [--data DIR]

``--data`` caches the prepared corpus (tokenizer and token arrays); a run that
finds it there skips the corpus and tokenizer steps, so the data can be prepared
on one machine (``--prepare-only``) and the models trained on another.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .tiny import MASK_TOKEN, SPECIAL_TOKENS, TinySpec, _qwen3_config, drafter_config

DEFAULT_OUT = Path(__file__).resolve().parent / "pairs" / "pycode-4l"
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class PairSpec:
    """Everything that defines a trained pair (recorded in its manifest)."""

    seed: int = 0
    # corpus
    corpus_bytes: int = 48_000_000  # text kept, after de-duplication
    heldout_permille: int = 30  # share of files held out
    tokenizer_bytes: int = 16_000_000  # text the BPE is trained on
    vocab_size: int = 4096  # special tokens included
    # sizes
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    draft_layers: int = 2
    block_size: int = 8
    target_layer_ids: tuple[int, ...] = (0, 2)
    max_position: int = 4096
    # target training
    target_steps: int = 3000  # at most: --time-limit can cap them
    target_batch: int = 64
    target_seq: int = 512
    target_lr: float = 3e-3
    # target continuations for the drafter
    gen_sequences: int = 8192  # half greedy, half sampled at T=1
    gen_prompt: int = 192
    gen_new: int = 128
    # drafter training
    draft_steps: int = 3000
    draft_batch: int = 64
    draft_anchors: int = 24  # blocks per sequence
    draft_lr: float = 3e-3
    soft_weight: float = 0.5  # share of the loss against the target's distribution
    depth_decay: float = 4.0  # loss weight of depth k: exp(-(k-1)/decay)
    # evaluation
    heldout_prompts: int = 64
    prompt_tokens: int = 96
    eval_new_tokens: int = 64

    @property
    def draft_seq(self) -> int:
        return self.gen_prompt + self.gen_new

    def tiny_spec(self) -> TinySpec:
        return TinySpec(
            seed=self.seed,
            hidden=self.hidden,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate=self.intermediate,
            draft_layers=self.draft_layers,
            block_size=self.block_size,
            target_layer_ids=self.target_layer_ids,
            max_position=self.max_position,
        )


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


class Log:
    """Prints and keeps every line (written to ``train_log.txt``)."""

    def __init__(self):
        self.lines: list[str] = []
        self.start = time.perf_counter()

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.start:7.1f}s] {msg}"
        self.lines.append(line)
        print(line, flush=True)


# --------------------------------------------------------------------------- corpus


def default_site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _usable(text: str) -> bool:
    if not text.strip():
        return False
    if sum(ch > "\x7f" for ch in text) > 0.02 * len(text):
        return False
    return max(len(line) for line in text.splitlines() or [""]) <= 400


def collect_corpus(root: Path, spec: PairSpec) -> dict:
    """Python files under ``root``: de-duplicated, a deterministic sample of
    ``corpus_bytes``, split into train / held-out by file."""
    seen: set[str] = set()
    docs = []
    for path in sorted(root.rglob("*.py")):
        if "__editable__" in path.name or not path.is_file():
            continue
        size = path.stat().st_size
        if size < 1_000 or size > 200_000:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen or not _usable(text):
            continue
        seen.add(digest)
        order = hashlib.sha256(f"{spec.seed}:{digest}".encode()).hexdigest()
        docs.append((order, digest, str(path.relative_to(root)), text))
    docs.sort()
    kept, total = [], 0
    for doc in docs:
        if total >= spec.corpus_bytes:
            break
        kept.append(doc)
        total += len(doc[3])
    train = [d for d in kept if int(d[1][:8], 16) % 1000 >= spec.heldout_permille]
    heldout = [d for d in kept if int(d[1][:8], 16) % 1000 < spec.heldout_permille]
    packages = sorted({d[2].split("/")[0] for d in kept})
    listing = "\n".join(sorted(d[2] + " " + d[1] for d in kept))
    return {
        "train": [d[3] for d in train],
        "heldout": [d[3] for d in heldout],
        "heldout_paths": [d[2] for d in heldout],
        "info": {
            "source": "Python source (*.py) of the installed packages in site-packages",
            "root": str(root),
            "python": platform.python_version(),
            "candidate_files": len(docs),
            "files": len(kept),
            "train_files": len(train),
            "heldout_files": len(heldout),
            "bytes": total,
            "train_bytes": sum(len(d[3]) for d in train),
            "heldout_bytes": sum(len(d[3]) for d in heldout),
            "packages": len(packages),
            "package_sample": packages[:40],
            "file_list_sha256": hashlib.sha256(listing.encode()).hexdigest(),
            "filters": "1-200 kB, UTF-8, <=2% non-ASCII, lines <=400 chars, exact duplicates dropped",
        },
    }


def train_tokenizer(texts: list[str], spec: PairSpec, folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sample, total = [], 0
    for text in texts:
        if total >= spec.tokenizer_bytes:
            break
        sample.append(text)
        total += len(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != EOS_TOKEN],
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)


def _encode(tok, texts: list[str]) -> list[np.ndarray]:
    out = []
    for i in range(0, len(texts), 256):
        for enc in tok.backend_tokenizer.encode_batch(texts[i : i + 256]):
            out.append(np.asarray(enc.ids, dtype=np.uint16))
    return out


def prepare_data(data: Path, spec: PairSpec, site_packages: Path, log: Log) -> None:
    """Corpus, tokenizer and token arrays into ``data`` (skipped when already there)."""
    key = _data_key(spec)
    done = data / "DONE.json"
    if done.exists() and json.loads(done.read_text()).get("key") == key:
        log(f"data: reusing {data}")
        return
    from transformers import AutoTokenizer

    log(f"data: collecting Python files under {site_packages}")
    corpus = collect_corpus(site_packages, spec)
    log(f"data: {json.dumps({k: v for k, v in corpus['info'].items() if k != 'package_sample'})}")
    tmp = data.with_name(data.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    train_tokenizer(corpus["train"], spec, tmp / "tokenizer")
    tok = AutoTokenizer.from_pretrained(tmp / "tokenizer")
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    log(f"data: tokenizer of {len(tok)} tokens trained; encoding")
    train_docs = _encode(tok, corpus["train"])
    heldout_docs = _encode(tok, corpus["heldout"])
    sep = np.asarray([eos], dtype=np.uint16)
    train = np.concatenate([x for doc in train_docs for x in (doc, sep)])
    heldout = np.concatenate([x for doc in heldout_docs for x in (doc, sep)])
    offsets = np.cumsum([0] + [len(d) + 1 for d in heldout_docs])[:-1]
    np.save(tmp / "train.npy", train)
    np.save(tmp / "heldout.npy", heldout)
    np.save(tmp / "heldout_offsets.npy", offsets.astype(np.int64))
    info = {
        **corpus["info"],
        "train_tokens": int(train.size),
        "heldout_tokens": int(heldout.size),
        "bytes_per_token": round(corpus["info"]["train_bytes"] / max(train.size, 1), 3),
    }
    (tmp / "heldout_paths.json").write_text(json.dumps(corpus["heldout_paths"]))
    (tmp / "DONE.json").write_text(json.dumps({"key": key, "corpus": info}, indent=1))
    shutil.rmtree(data, ignore_errors=True)
    data.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(data)
    log(f"data: {info['train_tokens']} train / {info['heldout_tokens']} held-out tokens in {data}")


def _data_key(spec: PairSpec) -> str:
    """The corpus root is left out: prepared data may move to another machine."""
    fields = ("seed", "corpus_bytes", "heldout_permille", "tokenizer_bytes", "vocab_size")
    blob = json.dumps({f: getattr(spec, f) for f in fields}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- models


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(head_dim: int, max_pos: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float), inv_freq)
    return freqs.cos(), freqs.sin()  # [max_pos, head_dim/2]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """``x`` [N, T, heads, d]; ``cos``/``sin`` [N or 1, T, d/2] (SGLang's apply_rotary_emb)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.float()
    if neox:
        x1, x2 = xf.chunk(2, dim=-1)
    else:
        x1, x2 = xf[..., ::2], xf[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.cat((o1, o2), dim=-1) if neox else torch.stack((o1, o2), dim=-1).flatten(-2)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: PairSpec):
        super().__init__()
        h, q, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.q_proj = nn.Linear(h, q, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.q_norm = RMSNorm(spec.head_dim)
        self.k_norm = RMSNorm(spec.head_dim)

    def qkv(self, x, heads_q=True):
        n, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, t, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, t, self.kv_heads, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(n, t, self.heads, self.head_dim)) if heads_q else None
        return q, k, v

    def attend(self, q, k, v, mask=None, causal=False):
        """q [N, Tq, H, d], k/v [N, Tk, KV, d] -> [N, Tq, H*d]."""
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=self.heads != self.kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1))


class MLP(nn.Module):
    def __init__(self, spec: PairSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden, spec.intermediate, bias=False)
        self.up_proj = nn.Linear(spec.hidden, spec.intermediate, bias=False)
        self.down_proj = nn.Linear(spec.intermediate, spec.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: PairSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden)
        self.mlp = MLP(spec)

    def ffn(self, h):
        return h + self.mlp(self.post_attention_layernorm(h))


class _Backbone(nn.Module):
    def __init__(self, spec: PairSpec, vocab: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, spec.hidden)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.hidden)


class Target(nn.Module):
    """Qwen3ForCausalLM; parameter names are the checkpoint's."""

    def __init__(self, spec: PairSpec, vocab: int):
        super().__init__()
        self.spec = spec
        self.model = _Backbone(spec, vocab)
        self.lm_head = nn.Linear(spec.hidden, vocab, bias=False)
        cos, sin = rope_tables(spec.head_dim, spec.max_position)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids, capture=(), cache=None, start=0):
        """``ids`` [N, T] at positions ``start..start+T-1``. Returns the final-norm
        hidden [N, T, H] and the outputs of the layers in ``capture``, concatenated
        [N, T, len(capture)*H]. ``cache``: per-layer [K, V] buffers [N, Tmax, KV, d]."""
        n, t = ids.shape
        h = self.model.embed_tokens(ids)
        cos, sin = self.cos[None, start : start + t], self.sin[None, start : start + t]
        feats = []
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(h))
            q, k = apply_rope(q, cos, sin, True), apply_rope(k, cos, sin, True)
            if cache is not None:
                cache[i][0][:, start : start + t] = k
                cache[i][1][:, start : start + t] = v
                k, v = cache[i][0][:, : start + t], cache[i][1][:, : start + t]
            h = h + attn.attend(q, k, v, causal=t > 1)
            h = layer.ffn(h)
            if i in capture:
                feats.append(h)
        out = self.model.norm(h)
        return out, (torch.cat(feats, dim=-1) if feats else None)

    def logits(self, hidden):
        return self.lm_head(hidden)

    def new_cache(self, n, length, dtype, device):
        shape = (n, length, self.spec.kv_heads, self.spec.head_dim)
        return [[torch.empty(shape, dtype=dtype, device=device) for _ in range(2)] for _ in self.model.layers]


class Drafter(nn.Module):
    """SGLang's DFlashDraftModel, plus the learned mask embedding."""

    def __init__(self, spec: PairSpec):
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.draft_layers))
        self.norm = RMSNorm(spec.hidden)
        self.fc = nn.Linear(len(spec.target_layer_ids) * spec.hidden, spec.hidden, bias=False)
        self.hidden_norm = RMSNorm(spec.hidden)
        self.mask_embedding = nn.Parameter(torch.zeros(spec.hidden))
        cos, sin = rope_tables(spec.head_dim, spec.max_position)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, block_embeds, block_pos, features, mask):
        """``block_embeds`` [N, Q, H] at ``block_pos`` [N, Q]; ``features`` [N, L, F]
        of the context tokens at positions 0..L-1; ``mask`` [N, 1, Q, L+Q] bool
        (True = visible). Returns the final-norm hidden [N, Q, H]."""
        ctx = self.hidden_norm(self.fc(features))
        length = ctx.shape[1]
        c_cos, c_sin = self.cos[None, :length], self.sin[None, :length]
        b_cos, b_sin = self.cos[block_pos], self.sin[block_pos]
        h = block_embeds
        for layer in self.layers:
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(h))
            _, kc, vc = attn.qkv(ctx, heads_q=False)  # no input norm on the context
            q, k = apply_rope(q, b_cos, b_sin, False), apply_rope(k, b_cos, b_sin, False)
            kc = apply_rope(kc, c_cos, c_sin, False)
            h = h + attn.attend(q, torch.cat((kc, k), 1), torch.cat((vc, v), 1), mask=mask)
            h = layer.ffn(h)
        return self.norm(h)


def init_weights(module: nn.Module, layers: int, gen: torch.Generator) -> None:
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            continue
        if name == "mask_embedding":
            nn.init.normal_(p, std=0.02, generator=gen)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers), generator=gen)
        else:
            nn.init.normal_(p, std=0.02, generator=gen)


# --------------------------------------------------------------------------- blocks


def sample_anchors(n: int, anchors: int, low: torch.Tensor, high: int, gen: torch.Generator) -> torch.Tensor:
    """``anchors`` distinct positions per row in ``[low[row], high]`` -> [n, anchors] sorted."""
    span = high + 1 - low  # [n]
    keys = torch.rand(n, int(span.max()), generator=gen)
    keys[torch.arange(keys.shape[1])[None, :] >= span[:, None]] = 2.0
    picks = keys.argsort(dim=1)[:, :anchors] + low[:, None]
    return picks.sort(dim=1).values


def block_layout(anchors: torch.Tensor, length: int, block: int):
    """Positions and the visibility mask of ``[anchor, MASK...]`` blocks.

    Returns ``pos`` [N, A*block] and ``mask`` [N, 1, A*block, length + A*block]: a
    block sees the context strictly before its anchor, and all of itself."""
    n, a = anchors.shape
    device = anchors.device
    offs = torch.arange(block, device=device)
    pos = (anchors[:, :, None] + offs).reshape(n, a * block)
    qa = anchors[:, :, None].expand(n, a, block).reshape(n, a * block)  # anchor of each query
    ctx_vis = torch.arange(length, device=device)[None, None, :] < qa[:, :, None]
    qb = torch.arange(a, device=device).repeat_interleave(block)
    blk_vis = (qb[:, None] == qb[None, :]).expand(n, -1, -1)
    return pos, torch.cat((ctx_vis, blk_vis), dim=-1)[:, None]


def draft_step_loss(target, drafter, seqs, anchors, spec: PairSpec, mask_id: int, autocast, soft_weight=None):
    """The DFlash block objective on ``seqs`` [N, L] at ``anchors`` [N, A].

    Returns (loss, per-depth hard CE [block-1], per-depth top-1 accuracy against the
    sequence tokens [block-1], draft logits [N, A, block-1, V])."""
    n, length = seqs.shape
    block = spec.block_size
    soft_weight = spec.soft_weight if soft_weight is None else soft_weight
    with torch.no_grad(), autocast():
        hidden, feats = target(seqs, capture=spec.target_layer_ids)
        tgt_logits = target.logits(hidden).float() if soft_weight > 0 else None
    pos, mask = block_layout(anchors, length, block)
    block_ids = torch.full_like(pos, mask_id)
    block_ids[:, ::block] = seqs.gather(1, anchors)
    with autocast():
        embeds = target.model.embed_tokens(block_ids)
        is_mask = (block_ids == mask_id)[..., None]
        embeds = torch.where(is_mask, drafter.mask_embedding.to(embeds.dtype), embeds)
        out = drafter(embeds, pos, feats.detach(), mask)
        out = out.view(n, -1, block, out.shape[-1])[:, :, 1:]
        logits = target.logits(out).float()  # [N, A, block-1, V]
    label_pos = pos.view(n, -1, block)[:, :, 1:]
    labels = seqs.gather(1, label_pos.reshape(n, -1)).view_as(label_pos)
    logp = logits.log_softmax(-1)
    hard = -logp.gather(-1, labels[..., None])[..., 0]  # [N, A, block-1]
    per_pos = hard
    if soft_weight > 0:
        prev = (label_pos - 1).reshape(n, -1)
        soft_p = tgt_logits.gather(1, prev[..., None].expand(-1, -1, tgt_logits.shape[-1]))
        soft_p = soft_p.view(*logits.shape).softmax(-1)
        soft = -(soft_p * logp).sum(-1)
        per_pos = (1 - soft_weight) * hard + soft_weight * soft
    depth = torch.arange(1, block, device=seqs.device, dtype=torch.float)
    weights = torch.exp(-(depth - 1) / spec.depth_decay)
    loss = (per_pos * weights).mean(dim=(0, 1)).sum() / weights.sum()
    acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
    return loss, hard.mean(dim=(0, 1)).detach(), acc.detach(), logits.detach()


# --------------------------------------------------------------------------- training


def _autocast_factory(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return lambda: torch.autocast("cpu", enabled=False)


def _optimizer(module: nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for n, p in module.named_parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for n, p in module.named_parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    fused = next(module.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused)


def _lr(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


class StepBudget:
    """Caps a phase's steps so that it ends within ``seconds``: the step time is
    measured over steps 5..20 and the cap is fixed from then on (the manifest
    records the steps actually run; pass them explicitly to reproduce a run)."""

    def __init__(self, steps: int, seconds: float, device: torch.device, log: Log, name: str):
        self.total, self.seconds, self.device, self.log, self.name = steps, seconds, device, log, name
        self.started = time.perf_counter()
        self._t5 = None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def after(self, step: int) -> None:
        """Call after each step (``step`` counted from 0)."""
        if step == 4 or (step == 19 and self._t5 is not None):
            self._sync()
            if step == 4:
                self._t5 = time.perf_counter()
                return
            per_step = (time.perf_counter() - self._t5) / 15
            left = self.seconds - (time.perf_counter() - self.started)
            cap = max(20, 20 + int(left / per_step))
            if cap < self.total:
                self.log(
                    f"{self.name}: {per_step * 1e3:.1f} ms/step; {self.total} steps capped to {cap} (time limit)"
                )
                self.total = cap
            else:
                self.log(f"{self.name}: {per_step * 1e3:.1f} ms/step")


def random_windows(stream: np.ndarray, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.size - length, (n,), generator=gen).numpy()
    return torch.from_numpy(np.stack([stream[s : s + length] for s in starts]).astype(np.int64))


def train_target(target, train, spec, device, log, seconds, gen) -> dict:
    opt = _optimizer(target, spec.target_lr)
    autocast = _autocast_factory(device)
    target.train()
    running = []
    budget = StepBudget(spec.target_steps, seconds, device, log, "target")
    started = time.perf_counter()
    step = 0
    while step < budget.total:
        for group in opt.param_groups:
            group["lr"] = _lr(step, budget.total, spec.target_lr)
        seqs = random_windows(train, spec.target_batch, spec.target_seq + 1, gen).to(device)
        with autocast():
            hidden, _ = target(seqs[:, :-1])
            logits = target.logits(hidden).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        opt.step()
        budget.after(step)
        step += 1
        if step % 10 == 0 or step == budget.total:
            running.append(loss.item())
        if step % 200 == 0 or step == 1 or step == budget.total:
            log(
                f"target: step {step}/{budget.total} loss {loss.item():.4f} ({time.perf_counter() - started:.0f}s)"
            )
    target.eval()
    return {"steps": step, "final_train_loss": float(np.mean(running[-20:]))}


@torch.no_grad()
def target_heldout_loss(target, heldout, spec, device, gen, batches=16) -> float:
    autocast = _autocast_factory(device)
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
    autocast = _autocast_factory(device)
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
        greedy = torch.arange(n) % 2 == 0
        chunks.append(generate(target, prompts, spec.gen_new, greedy, gen, device).cpu())
    out = torch.cat(chunks)
    log(f"continuations: {out.shape[0]} x {out.shape[1]} tokens in {time.perf_counter() - started:.0f}s")
    return out


def draft_batch(train, generated, spec, gen):
    """Half corpus windows (anchors anywhere), half target continuations (anchors
    in the generated part)."""
    n_gen = spec.draft_batch // 2
    n_corpus = spec.draft_batch - n_gen
    length, block = spec.draft_seq, spec.block_size
    rows = torch.randint(0, generated.shape[0], (n_gen,), generator=gen)
    seqs = torch.cat((random_windows(train, n_corpus, length, gen), generated[rows]))
    low = torch.cat((torch.ones(n_corpus, dtype=torch.int64), torch.full((n_gen,), spec.gen_prompt)))
    anchors = sample_anchors(spec.draft_batch, spec.draft_anchors, low, length - block, gen)
    return seqs, anchors


def train_drafter(target, drafter, train, generated, spec, mask_id, device, log, seconds, gen) -> dict:
    for p in target.parameters():
        p.requires_grad_(False)
    opt = _optimizer(drafter, spec.draft_lr)
    autocast = _autocast_factory(device)
    drafter.train()
    recent = []
    budget = StepBudget(spec.draft_steps, seconds, device, log, "drafter")
    started = time.perf_counter()
    step = 0
    while step < budget.total:
        for group in opt.param_groups:
            group["lr"] = _lr(step, budget.total, spec.draft_lr)
        seqs, anchors = draft_batch(train, generated, spec, gen)
        loss, hard, acc, _ = draft_step_loss(
            target, drafter, seqs.to(device), anchors.to(device), spec, mask_id, autocast
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        budget.after(step)
        step += 1
        if step % 10 == 0 or step == budget.total:
            recent.append(loss.item())
        if step % 200 == 0 or step == 1 or step == budget.total:
            log(
                f"drafter: step {step}/{budget.total} loss {loss.item():.4f} "
                f"top-1@depth {' '.join(f'{a:.2f}' for a in acc.tolist())} "
                f"({time.perf_counter() - started:.0f}s)"
            )
    drafter.eval()
    return {"steps": step, "final_train_loss": float(np.mean(recent[-20:]))}


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
    autocast = _autocast_factory(device)
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


# --------------------------------------------------------------------------- export


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
    deadline = time.perf_counter() + time_limit_s
    t0 = time.perf_counter()
    target_stats = train_target(target, train, spec, device, log, 0.5 * time_limit_s, gen)
    _bf16_roundtrip(target)
    target_stats["heldout_loss"] = target_heldout_loss(
        target, heldout, spec, device, torch.Generator().manual_seed(1)
    )
    target_stats["seconds"] = round(time.perf_counter() - t0, 1)
    log(f"target: {json.dumps(target_stats)}")

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
    tgt_params = count_params(target.state_dict().values())
    dr_params = count_params(v for k, v in drafter.state_dict().items() if k != "mask_embedding")
    manifest = {
        "name": out.name,
        "created_utc": started_at,
        "command": "python -m sglang_ddtree.models.train_pair " + " ".join(sys.argv[1:]),
        "machine": {
            "device": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.processor() or "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "seed": spec.seed,
        "spec": asdict(spec),
        "corpus": corpus,
        "tokenizer": {
            "vocab_size": vocab,
            "mask_token": MASK_TOKEN,
            "mask_token_id": mask_id,
            "eos_token": EOS_TOKEN,
        },
        "sizes": {
            "target_params": tgt_params,
            "drafter_params": dr_params,
            "target_bytes": (out / "target" / "model.safetensors").stat().st_size,
            "drafter_bytes": (out / "drafter" / "model.safetensors").stat().st_size,
            "dtype": "bfloat16",
        },
        "target": target_stats,
        "drafter": draft_stats,
        "losses_after_bf16_rounding": True,
        "heldout_prompts": len(prompts),
        "seconds_total": round(time.perf_counter() - log.start, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"wrote {out} (target {tgt_params / 1e6:.2f}M, drafter {dr_params / 1e6:.2f}M params)")
    (out / "train_log.txt").write_text("\n".join(log.lines) + "\n")
    return manifest


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
    from .tiny import default_cache_dir

    data = args.data or default_cache_dir().parent / "pair-data" / ("smoke" if args.smoke else "full")
    site = args.site_packages or default_site_packages()
    if args.prepare_only:
        prepare_data(data, spec, site, Log())
        return
    run(spec, args.out, data, site, torch.device(args.device), args.time_limit * 60)


if __name__ == "__main__":
    main()
