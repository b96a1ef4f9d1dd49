"""Tree-verify attention at MLA decode shapes: the Triton prefix/tail split
(``SplitTreeAttention``) beside its reference (``naive_tree_attention``).

Absorbed MLA: every query head attends over one shared latent cache whose rows are
576 wide (512 latent + 64 rope); the values are the first 512 columns of the same rows.
A verify step of ``bs`` requests carries ``W = budget + 1`` tree nodes per request; node i
sees the whole committed prefix plus its own ancestors in the tree (itself included).

* ``naive_tree_attention``: scores over prefix + tree with a materialised [bs, W, L + W]
  mask, in torch; ``fp32=True`` is the float32 reference every fast path is checked against.
* ``SplitTreeAttention``: a Triton split-KV pass over the prefix in which the ``W x heads``
  query rows of one request share every K/V tile they load (one read of the prefix per row
  tile), a small masked pass over the tree tail, and a log-sum-exp merge of the parts.

Shapes: ``bs`` requests, ``W`` (= ``n_nodes``) tree nodes each, ``H`` heads, ``L`` prefix
tokens per request, ``rows = W x H`` query rows per request (node-major). The benchmark is
``python -m lab.bench.mla_tree_attention``. Importing this module needs no GPU and
no Triton (the reference and the split choices still work without it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

D_LATENT, D_ROPE = 512, 64
D_QK = D_LATENT + D_ROPE
SM_SCALE = 1.0 / math.sqrt(128 + 64)  # K2: qk_nope_head_dim 128 + qk_rope_head_dim 64
FLOPS_PER_QK_PAIR = 2 * (D_QK + D_LATENT)  # one query row x one key: QK^T over 576 + PV over 512
LOG2E = 1.4426950408889634

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference and the bookkeeping still work
    triton = None


@dataclass
class TreeVerifyProblem:
    """One verify step: ``bs`` requests, prefix ``prefix_len`` each, ``n_nodes`` tree nodes, ``heads`` heads."""

    q: torch.Tensor  # [bs, W, H, 576]
    kv_pool: torch.Tensor  # [tokens, 576] committed latent cache (values = first 512 columns)
    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # [tokens] int32, pool slot of each prefix token
    k_tree: torch.Tensor  # [bs, W, 576] latent rows of the tree nodes
    tree_mask: torch.Tensor  # [bs, W, W] int8, ancestor-or-self

    @property
    def bs(self) -> int:
        return self.q.shape[0]

    @property
    def n_nodes(self) -> int:
        return self.q.shape[1]

    @property
    def heads(self) -> int:
        return self.q.shape[2]


def prefix_view(p: TreeVerifyProblem) -> torch.Tensor:
    """[bs, L, 576] view of the prefix (the pool is laid out request after request here)."""
    L = p.kv_pool.shape[0] // p.bs
    return p.kv_pool.view(p.bs, L, D_QK)


# =========================================================================== reference


def naive_tree_attention(
    p: TreeVerifyProblem, *, fp32: bool = False, max_elems: int = 1 << 30
) -> torch.Tensor:
    """Masked attention over prefix + tree with a materialised mask. [bs, W, H, 512].

    bf16 score/value products with a float32 softmax (``fp32=True``: everything in float32,
    the reference). Requests are processed in chunks so one score tensor stays under
    ``max_elems`` elements.
    """
    bs, W, H, _ = p.q.shape
    prefix = prefix_view(p)
    L = prefix.shape[1]
    chunk = max(1, min(bs, max_elems // max(1, H * W * (L + W))))
    outs = []
    for b0 in range(0, bs, chunk):
        b1 = min(bs, b0 + chunk)
        k = torch.cat([prefix[b0:b1], p.k_tree[b0:b1]], dim=1)  # [c, L + W, 576]
        q = p.q[b0:b1]
        if fp32:
            k, q = k.float(), q.float()
        s = torch.einsum("bwhd,bnd->bhwn", q, k).float() * SM_SCALE  # [c, H, W, L + W]
        mask = torch.cat(
            [torch.ones(b1 - b0, W, L, dtype=torch.bool, device=q.device), p.tree_mask[b0:b1] != 0], -1
        )
        s.masked_fill_(~mask[:, None], float("-inf"))
        prob = torch.softmax(s, dim=-1)
        v = k[..., :D_LATENT]
        o = torch.einsum("bhwn,bnd->bwhd", prob if fp32 else prob.to(v.dtype), v)
        outs.append(o.to(torch.bfloat16) if not fp32 else o)
    return torch.cat(outs, 0)


# =========================================================================== Triton split


if triton is not None:

    @triton.jit
    def _partial_kernel(
        Q,  # [bs, rows, 576] (rows = W x H, node-major)
        KV,  # [tokens, 576] committed latent cache
        kv_indptr,
        kv_indices,
        KT,  # [bs, W, 576] tree latent rows
        MASK,  # [bs, W, W] int8 ancestor-or-self, or SGLang's flat verify mask (FLAT_MASK)
        mask_indptr,  # FLAT_MASK: [bs + 1] start of each request's [W, prefix + W] block
        O_part,  # [bs, n_splits + 1, rows, 512] bf16, normalised per part
        LSE_part,  # [bs, n_splits + 1, rows] fp32, log2 domain
        qk_scale,  # sm_scale * log2(e)
        rows,
        n_heads,
        n_nodes,
        n_splits,
        stride_qb,
        stride_qr,
        stride_kv,
        stride_kb,
        stride_kt,
        stride_mb,
        stride_mi,
        stride_ob,
        stride_os,
        stride_or,
        stride_lb,
        stride_ls,
        D_NOPE: tl.constexpr,
        D_PE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IS_TAIL: tl.constexpr,
        CONTIG: tl.constexpr,
        FLAT_MASK: tl.constexpr,
    ):
        """Prefix launch (IS_TAIL=False): part p = slice p of the prefix.  Tail launch: part
        n_splits = the tree tail under the ancestor mask.  Two specialisations of one kernel, so
        each compiles only its own loop.  The W x H query rows of a request share every key tile.
        CONTIG: the request's cache slots are consecutive (index arithmetic instead of a gather).
        FLAT_MASK: the tree mask is SGLang's target-verify mask (per request ``W`` rows over
        ``prefix + W`` keys, row-major, at ``mask_indptr[b]``); its tree columns are read.
        """
        tile = tl.program_id(0)
        part = tl.program_id(1) + (n_splits if IS_TAIL else 0)
        b = tl.program_id(2)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < rows
        offs_d = tl.arange(0, D_NOPE)
        offs_p = tl.arange(0, D_PE)
        q_ptr = Q + b.to(tl.int64) * stride_qb + offs_m[:, None] * stride_qr
        q_nope = tl.load(q_ptr + offs_d[None, :], mask=m_mask[:, None], other=0.0)
        q_pe = tl.load(q_ptr + D_NOPE + offs_p[None, :], mask=m_mask[:, None], other=0.0)
        if not IS_TAIL:
            m_i, l_i, acc = _prefix_part(
                q_nope, q_pe, KV, kv_indptr, kv_indices, b, part, n_splits, stride_kv, qk_scale,
                D_NOPE, D_PE, BLOCK_M, BLOCK_N, CONTIG,
            )  # fmt: skip
        else:
            m_i, l_i, acc = _tail_part(
                q_nope, q_pe, KT, MASK, mask_indptr, kv_indptr, b, offs_m, m_mask, n_heads, n_nodes,
                stride_kb, stride_kt, stride_mb, stride_mi, qk_scale, D_NOPE, D_PE, BLOCK_M, BLOCK_N, FLAT_MASK,
            )  # fmt: skip

        has = l_i > 0
        o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        o_ptr = O_part + b.to(tl.int64) * stride_ob + part * stride_os + offs_m[:, None] * stride_or
        tl.store(o_ptr + offs_d[None, :], o.to(O_part.dtype.element_ty), mask=m_mask[:, None])
        tl.store(LSE_part + b * stride_lb + part * stride_ls + offs_m, lse, mask=m_mask)

    @triton.jit
    def _scores(q_nope, q_pe, k_ptr, k_mask, D_NOPE: tl.constexpr, D_PE: tl.constexpr):
        """QK^T of a row tile against one key tile (576 = 512 latent + 64 rope); also returns the
        latent part of the keys, which are the values."""
        offs_d = tl.arange(0, D_NOPE)
        offs_p = tl.arange(0, D_PE)
        k_nope = tl.load(k_ptr + offs_d[None, :], mask=k_mask[:, None], other=0.0)  # also V
        k_pe = tl.load(k_ptr + D_NOPE + offs_p[None, :], mask=k_mask[:, None], other=0.0)
        s = tl.dot(q_nope, tl.trans(k_nope))
        s = tl.dot(q_pe, tl.trans(k_pe), s)
        return s, k_nope

    @triton.jit
    def _online_softmax(s, v, m_i, l_i, acc, ALL_MASKED_SAFE: tl.constexpr):
        """One key tile into the running max / sum / weighted values (log2 domain).
        ALL_MASKED_SAFE: a row may see no key in this tile (the tree tail); keep it finite."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if ALL_MASKED_SAFE:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        return m_new, l_i, acc

    @triton.jit
    def _prefix_part(
        q_nope, q_pe, KV, kv_indptr, kv_indices, b, part, n_splits, stride_kv, qk_scale,
        D_NOPE: tl.constexpr, D_PE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CONTIG: tl.constexpr,
    ):  # fmt: skip
        """Slice ``part`` of request b's committed prefix, every key visible."""
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_NOPE], dtype=tl.float32)
        kv_start = tl.load(kv_indptr + b)
        kv_len = tl.load(kv_indptr + b + 1) - kv_start
        blocks_per_split = tl.cdiv(tl.cdiv(kv_len, BLOCK_N), n_splits)
        lo = part * blocks_per_split * BLOCK_N
        hi = tl.minimum(lo + blocks_per_split * BLOCK_N, kv_len)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < hi
            if CONTIG:
                loc = (tl.load(kv_indices + kv_start) + offs_n).to(tl.int64)
            else:
                loc = tl.load(kv_indices + kv_start + offs_n, mask=n_mask, other=0).to(tl.int64)
            s, v = _scores(q_nope, q_pe, KV + loc[:, None] * stride_kv, n_mask, D_NOPE, D_PE)
            s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, False)
        return m_i, l_i, acc

    @triton.jit
    def _tail_part(
        q_nope, q_pe, KT, MASK, mask_indptr, kv_indptr, b, offs_m, m_mask, n_heads, n_nodes,
        stride_kb, stride_kt, stride_mb, stride_mi, qk_scale,
        D_NOPE: tl.constexpr, D_PE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        FLAT_MASK: tl.constexpr,
    ):  # fmt: skip
        """Request b's tree nodes, each row seeing its node's ancestors (and itself) only."""
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_NOPE], dtype=tl.float32)
        node = offs_m // n_heads
        if FLAT_MASK:
            prefix_len = (tl.load(kv_indptr + b + 1) - tl.load(kv_indptr + b)).to(tl.int64)
            mask_rows = MASK + tl.load(mask_indptr + b).to(tl.int64) + prefix_len
            mask_rows += node[:, None].to(tl.int64) * (prefix_len + n_nodes)
        else:
            mask_rows = MASK + b * stride_mb + node[:, None] * stride_mi
        for t0 in range(0, n_nodes, BLOCK_N):
            offs_t = t0 + tl.arange(0, BLOCK_N)
            t_mask = offs_t < n_nodes
            k_ptr = KT + b.to(tl.int64) * stride_kb + offs_t[:, None] * stride_kt
            s, v = _scores(q_nope, q_pe, k_ptr, t_mask, D_NOPE, D_PE)
            vis = tl.load(mask_rows + offs_t[None, :], mask=m_mask[:, None] & t_mask[None, :], other=0)
            s = tl.where(vis != 0, s * qk_scale, float("-inf"))
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, True)
        return m_i, l_i, acc

    @triton.jit
    def _combine_kernel(
        O_part,
        LSE_part,
        Out,  # [bs, rows, 512]
        n_parts,
        stride_ob,
        stride_os,
        stride_or,
        stride_lb,
        stride_ls,
        stride_outb,
        stride_outr,
        NS_PAD: tl.constexpr,
        D_CHUNK: tl.constexpr,
    ):
        """Log-sum-exp merge of all parts of one row (one D chunk), in one 2D load: no serial chain."""
        row = tl.program_id(0)
        dc = tl.program_id(1)
        b = tl.program_id(2)
        offs_s = tl.arange(0, NS_PAD)
        s_mask = offs_s < n_parts
        offs_d = dc * D_CHUNK + tl.arange(0, D_CHUNK)
        lse = tl.load(LSE_part + b * stride_lb + offs_s * stride_ls + row, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.exp2(lse - m)
        o = tl.load(
            O_part
            + b.to(tl.int64) * stride_ob
            + offs_s[:, None] * stride_os
            + row * stride_or
            + offs_d[None, :],
            mask=s_mask[:, None],
            other=0.0,
        ).to(tl.float32)
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(
            Out + b.to(tl.int64) * stride_outb + row * stride_outr + offs_d, out.to(Out.dtype.element_ty)
        )


@dataclass(frozen=True)
class SplitConfig:
    block_m: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2

    def label(self) -> str:
        return f"M{self.block_m}N{self.block_n}w{self.num_warps}s{self.num_stages}"


CANDIDATE_CONFIGS = (
    SplitConfig(64, 64, 8, 2),
    SplitConfig(64, 32, 8, 2),
    SplitConfig(32, 64, 4, 2),
    SplitConfig(16, 64, 4, 3),
    SplitConfig(16, 32, 4, 4),
    SplitConfig(32, 32, 4, 3),
)


def choose_splits(bs: int, rows: int, prefix_len: int, block_m: int, sms: int, min_keys: int = 256) -> int:
    """Prefix splits per (request, row tile): about two programs per SM, at least ``min_keys`` keys each."""
    tiles = -(-rows // block_m)
    want = -(-2 * sms // max(1, bs * tiles))
    return int(max(1, min(want, -(-prefix_len // min_keys), 64)))


def choose_d_chunks(bs: int, rows: int, sms: int) -> int:
    """Split the 512 output columns of the merge across programs until there are ~4 per SM."""
    chunks = 1
    while chunks < 8 and bs * rows * chunks < 4 * sms:
        chunks *= 2
    return chunks


def launch_partial(q, kv, kv_indptr, kv_indices, k_tree, mask, mask_indptr, o_part, lse_part, qk_scale: float,
                   heads: int, n_nodes: int, cfg: SplitConfig, tail: bool, contiguous: bool = False,
                   flat_mask: bool = False) -> None:  # fmt: skip
    """One launch of the partial kernel: the prefix parts (``tail=False``) or the tree-tail part.
    ``q`` ``[bs, rows, 576]``, ``kv`` ``[tokens, 576]``, ``k_tree`` ``[bs, W, 576]``; the parts
    ``[bs, n_splits + 1, rows, 512]`` and ``[bs, n_splits + 1, rows]``."""
    bs, rows = q.shape[0], q.shape[1]
    n_splits = o_part.shape[1] - 1
    grid = (-(-rows // cfg.block_m), 1 if tail else n_splits, bs)
    mask_strides = (0, 0) if flat_mask else (mask.stride(0), mask.stride(1))
    _partial_kernel[grid](
        q, kv, kv_indptr, kv_indices, k_tree, mask, mask_indptr, o_part, lse_part,
        qk_scale, rows, heads, n_nodes, n_splits,
        q.stride(0), q.stride(1), kv.stride(0), k_tree.stride(0), k_tree.stride(1), *mask_strides,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        D_NOPE=D_LATENT, D_PE=D_ROPE, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, IS_TAIL=tail, CONTIG=contiguous,
        FLAT_MASK=flat_mask, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def launch_combine(o_part, lse_part, out, d_chunks: int) -> None:
    """The log-sum-exp merge of every part into ``out`` ``[bs, rows, 512]``."""
    bs, n_parts, rows = o_part.shape[0], o_part.shape[1], o_part.shape[2]
    _combine_kernel[(rows, d_chunks, bs)](
        o_part, lse_part, out, n_parts,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1),
        NS_PAD=max(2, triton.next_power_of_2(n_parts)), D_CHUNK=D_LATENT // d_chunks,
        num_warps=4 if D_LATENT // d_chunks >= 256 else 2,
    )  # fmt: skip


class SplitTreeAttention:
    """Prefix split-KV parts + masked tree tail part, then one LSE merge; buffers owned (graph-safe)."""

    def __init__(self, p: TreeVerifyProblem, cfg: SplitConfig, sms: int):
        self.p, self.cfg, self.sms = p, cfg, sms
        self.rows = p.n_nodes * p.heads
        L = p.kv_pool.shape[0] // p.bs
        self.q = p.q.view(p.bs, self.rows, D_QK)
        self.out = torch.empty(p.bs, self.rows, D_LATENT, device=p.q.device, dtype=p.q.dtype)
        self.d_chunks = choose_d_chunks(p.bs, self.rows, sms)
        self.set_splits(choose_splits(p.bs, self.rows, L, cfg.block_m, sms))

    def set_splits(self, n_splits: int, dtype=None) -> None:
        p = self.p
        self.n_splits = n_splits
        dt = dtype or (torch.bfloat16 if p.q.dtype == torch.bfloat16 else p.q.dtype)
        self.o_part = torch.empty(p.bs, n_splits + 1, self.rows, D_LATENT, device=p.q.device, dtype=dt)
        self.lse_part = torch.empty(p.bs, n_splits + 1, self.rows, device=p.q.device, dtype=torch.float32)

    def partials(self, contiguous: bool = False):
        """Prefix parts and the tree-tail part (two launches of the partial kernel)."""
        self._launch_partial(False, contiguous)
        self._launch_partial(True, False)

    def _launch_partial(self, tail: bool, contiguous: bool):
        p = self.p
        launch_partial(
            self.q, p.kv_pool, p.kv_indptr, p.kv_indices, p.k_tree, p.tree_mask, p.kv_indptr,
            self.o_part, self.lse_part, SM_SCALE * LOG2E, p.heads, p.n_nodes, self.cfg, tail, contiguous,
        )  # fmt: skip

    def combine(self):
        launch_combine(self.o_part, self.lse_part, self.out, self.d_chunks)

    def __call__(self) -> torch.Tensor:
        self.partials()
        self.combine()
        return self.out.view(self.p.bs, self.p.n_nodes, self.p.heads, D_LATENT)
