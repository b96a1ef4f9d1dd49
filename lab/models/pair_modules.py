"""The trained pair's model pieces in plain torch: the spec that sizes them, the Qwen3-style
target, the DFlash block drafter, and the block layout and loss that tie them together
(used by ``train_pair`` to train them and by ``bench/pair_eval_replay`` to replay them).

The code mirrors what SGLang serves: the target is HF/SGLang Qwen3 (neox rope), the drafter
is SGLang's ``DFlashDraftModel`` (context K/V from ``hidden_norm(fc(features))`` with no
input norm, interleaved rope since the config says ``rope_is_neox_style: false``,
non-causal attention), and the features for ``target_layer_ids`` k are the outputs of
target layer k (SGLang captures "before layer k+1").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lab.models.tiny import TinySpec


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
    gen_greedy_share: float = 0.5  # the rest sampled at T=1
    # drafter training
    draft_steps: int = 3000
    draft_batch: int = 64
    draft_anchors: int = 24  # blocks per sequence
    draft_lr: float = 3e-3
    draft_gen_share: float = 0.5  # share of each batch from the continuations, the rest corpus windows
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
