"""Tree-verify attention at Kimi K2.6 MLA decode shapes: naive masked attention vs prefix/tail split.

Absorbed MLA: every query head attends over one shared latent cache whose rows are
576 wide (512 latent + 64 rope); the values are the first 512 columns of the same rows.
A verify step of ``bs`` requests carries ``W = budget + 1`` tree nodes per request; node i
sees the whole committed prefix plus its own ancestors in the tree (itself included).

(a) naive: scores over prefix + tree with a materialised [bs, W, L + W] mask, in torch.
(b) split: a Triton split-KV pass over the prefix in which the ``W x heads`` query rows of
    one request share every K/V tile they load (one read of the prefix per row tile), a
    small masked pass over the tree tail, and a log-sum-exp merge of the two (the merge is
    fused into the tail kernel).

Both are checked against a float32 reference on awkward sizes before anything is timed.
Reported per shape: time, bytes / time against the copy bandwidth measured in the same run,
FLOP / time against the measured bf16 matmul rate, and which of the two bounds the prefix.

    python -m sglang_ddtree.bench.mla_tree_attention          # -> bench_results/mla_tree_attention.*
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
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


# =========================================================================== trees


def random_tree_parents(n_nodes: int, gen: torch.Generator) -> list[int]:
    """Parents of a random tree over nodes 0..n-1 in topological order (parent[i] < i, root -1)."""
    parents = [-1]
    for i in range(1, n_nodes):
        # Favour recent nodes a little so that trees get deep paths as well as wide fans.
        lo = max(0, i - 8) if torch.rand((), generator=gen).item() < 0.6 else 0
        parents.append(int(torch.randint(lo, i, (), generator=gen).item()))
    return parents


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: mask[i, j] = node j is node i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


# =========================================================================== problem


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


def make_problem(
    bs: int, prefix_len: int, n_nodes: int, heads: int, device="cuda", seed: int = 0
) -> TreeVerifyProblem:
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(bs, n_nodes, heads, D_QK, device=device, dtype=torch.bfloat16, generator=dgen)
    kv_pool = torch.randn(bs * prefix_len, D_QK, device=device, dtype=torch.bfloat16, generator=dgen)
    k_tree = torch.randn(bs, n_nodes, D_QK, device=device, dtype=torch.bfloat16, generator=dgen)
    kv_indptr = torch.arange(0, bs + 1, device=device, dtype=torch.int32) * prefix_len
    kv_indices = torch.arange(bs * prefix_len, device=device, dtype=torch.int32)
    masks = [ancestor_mask(random_tree_parents(n_nodes, gen)) for _ in range(bs)]
    tree_mask = torch.stack(masks).to(device=device, dtype=torch.int8)
    return TreeVerifyProblem(q, kv_pool, kv_indptr, kv_indices, k_tree, tree_mask)


def prefix_view(p: TreeVerifyProblem) -> torch.Tensor:
    """[bs, L, 576] view of the prefix (the pool is laid out request after request here)."""
    L = p.kv_pool.shape[0] // p.bs
    return p.kv_pool.view(p.bs, L, D_QK)


# =========================================================================== (a) naive


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


# =========================================================================== (b) split


if triton is not None:

    @triton.jit
    def _partial_kernel(
        Q,  # [bs, rows, 576] (rows = W x H, node-major)
        KV,  # [tokens, 576] committed latent cache
        kv_indptr,
        kv_indices,
        KT,  # [bs, W, 576] tree latent rows
        MASK,  # [bs, W, W] int8 ancestor-or-self
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
    ):
        """Prefix launch (IS_TAIL=False): part p = slice p of the prefix.  Tail launch: part
        n_splits = the tree tail under the ancestor mask.  Two specialisations of one kernel, so
        each compiles only its own loop.  The W x H query rows of a request share every key tile.
        CONTIG: the request's cache slots are consecutive (index arithmetic instead of a gather).
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

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_NOPE], dtype=tl.float32)
        if not IS_TAIL:
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
                k_ptr = KV + loc[:, None] * stride_kv
                k_nope = tl.load(k_ptr + offs_d[None, :], mask=n_mask[:, None], other=0.0)  # also V
                k_pe = tl.load(k_ptr + D_NOPE + offs_p[None, :], mask=n_mask[:, None], other=0.0)
                s = tl.dot(q_nope, tl.trans(k_nope))
                s = tl.dot(q_pe, tl.trans(k_pe), s)
                s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = tl.dot(p.to(k_nope.dtype), k_nope, acc * alpha[:, None])
                m_i = m_new
        else:
            node = offs_m // n_heads
            for t0 in range(0, n_nodes, BLOCK_N):
                offs_t = t0 + tl.arange(0, BLOCK_N)
                t_mask = offs_t < n_nodes
                k_ptr = KT + b.to(tl.int64) * stride_kb + offs_t[:, None] * stride_kt
                k_nope = tl.load(k_ptr + offs_d[None, :], mask=t_mask[:, None], other=0.0)
                k_pe = tl.load(k_ptr + D_NOPE + offs_p[None, :], mask=t_mask[:, None], other=0.0)
                s = tl.dot(q_nope, tl.trans(k_nope))
                s = tl.dot(q_pe, tl.trans(k_pe), s)
                vis = tl.load(
                    MASK + b * stride_mb + node[:, None] * stride_mi + offs_t[None, :],
                    mask=m_mask[:, None] & t_mask[None, :],
                    other=0,
                )
                s = tl.where(vis != 0, s * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = tl.dot(p.to(k_nope.dtype), k_nope, acc * alpha[:, None])
                m_i = m_new

        has = l_i > 0
        o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        o_ptr = O_part + b.to(tl.int64) * stride_ob + part * stride_os + offs_m[:, None] * stride_or
        tl.store(o_ptr + offs_d[None, :], o.to(O_part.dtype.element_ty), mask=m_mask[:, None])
        tl.store(LSE_part + b * stride_lb + part * stride_ls + offs_m, lse, mask=m_mask)

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
        p, c = self.p, self.cfg
        grid = (-(-self.rows // c.block_m), 1 if tail else self.n_splits, p.bs)
        _partial_kernel[grid](
            self.q, p.kv_pool, p.kv_indptr, p.kv_indices, p.k_tree, p.tree_mask, self.o_part, self.lse_part,
            SM_SCALE * LOG2E, self.rows, p.heads, p.n_nodes, self.n_splits,
            self.q.stride(0), self.q.stride(1), p.kv_pool.stride(0), p.k_tree.stride(0), p.k_tree.stride(1),
            p.tree_mask.stride(0), p.tree_mask.stride(1),
            self.o_part.stride(0), self.o_part.stride(1), self.o_part.stride(2),
            self.lse_part.stride(0), self.lse_part.stride(1),
            D_NOPE=D_LATENT, D_PE=D_ROPE, BLOCK_M=c.block_m, BLOCK_N=c.block_n, IS_TAIL=tail, CONTIG=contiguous,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip

    def combine(self):
        p = self.p
        n_parts = self.n_splits + 1
        grid = (self.rows, self.d_chunks, p.bs)
        _combine_kernel[grid](
            self.o_part, self.lse_part, self.out, n_parts,
            self.o_part.stride(0), self.o_part.stride(1), self.o_part.stride(2),
            self.lse_part.stride(0), self.lse_part.stride(1), self.out.stride(0), self.out.stride(1),
            NS_PAD=max(2, triton.next_power_of_2(n_parts)), D_CHUNK=D_LATENT // self.d_chunks,
            num_warps=4 if D_LATENT // self.d_chunks >= 256 else 2,
        )  # fmt: skip

    def __call__(self) -> torch.Tensor:
        self.partials()
        self.combine()
        return self.out.view(self.p.bs, self.p.n_nodes, self.p.heads, D_LATENT)


# =========================================================================== accounting


def prefix_bytes(bs: int, prefix_len: int) -> int:
    """The fewest bytes the prefix pass must read: each request's latent cache once."""
    return bs * prefix_len * D_QK * 2


def io_bytes(bs: int, n_nodes: int, heads: int) -> int:
    """Queries + tree rows + mask in, outputs out (bf16)."""
    rows = n_nodes * heads
    return bs * (rows * D_QK * 2 + n_nodes * D_QK * 2 + n_nodes * n_nodes + rows * D_LATENT * 2)


def attention_flops(bs: int, prefix_len: int, n_nodes: int, heads: int) -> tuple[float, float]:
    """(prefix, tail) FLOPs, counting every (query row, key) pair of the dense score matrix."""
    rows = n_nodes * heads
    return float(bs * rows * prefix_len * FLOPS_PER_QK_PAIR), float(bs * rows * n_nodes * FLOPS_PER_QK_PAIR)


def roofline(bytes_: float, flops: float, copy_gbs: float, mm_tflops: float) -> dict:
    t_mem, t_mm = bytes_ / (copy_gbs * 1e9), flops / (mm_tflops * 1e12)
    return {"floor_ms": 1e3 * max(t_mem, t_mm), "bound": "memory" if t_mem >= t_mm else "compute"}


# =========================================================================== benchmark


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(configs: Sequence[SplitConfig], sms: int) -> list[dict]:
    """split == naive == float32 reference on awkward sizes; every output element written."""
    out = []
    for heads in (8, 64):
        for n_nodes in (1, 17, 33, 65):
            for L in (1000, 4097):
                p = make_problem(2, L, n_nodes, heads, seed=L + n_nodes + heads)
                ref = naive_tree_attention(p, fp32=True)
                naive = naive_tree_attention(p)
                for cfg in configs:
                    att = SplitTreeAttention(p, cfg, sms)
                    att.out.fill_(float("nan"))
                    try:
                        got = att()
                        torch.cuda.synchronize()
                    except Exception as exc:  # a config the compiler cannot fit is reported, not fatal
                        out.append({"heads": heads, "n_nodes": n_nodes, "prefix": L, "config": cfg.label(),
                                    "error": f"{type(exc).__name__}: {str(exc)[:200]}", "ok": None})  # fmt: skip
                        print(f"[mla] check {cfg.label()}: {out[-1]['error']}", flush=True)
                        continue
                    finite = bool(torch.isfinite(got).all())
                    e_split, e_naive, e_sn = _rel(got, ref), _rel(naive, ref), _rel(got, naive)
                    ok = finite and e_split < 1e-2 and e_sn < 2e-2
                    out.append({"heads": heads, "n_nodes": n_nodes, "prefix": L, "config": cfg.label(),
                                "n_splits": att.n_splits, "rel_err_split": e_split, "rel_err_naive": e_naive,
                                "rel_split_vs_naive": e_sn, "all_written": finite, "ok": ok})  # fmt: skip
                    if not ok:
                        print(f"[mla] CHECK FAILED {out[-1]}", flush=True)
    return out


def _time(fn, reps_target_ms: float = 150.0) -> float:
    """Median ms per call: CUDA-graph replay, repetitions sized to about ``reps_target_ms``."""
    from sglang_ddtree.bench._stamp import time_eager, time_graph

    t0 = time_eager(fn, reps=1, warmup=1)["median_ms"]
    reps = int(max(3, min(30, reps_target_ms / max(t0, 1e-3))))
    try:
        return time_graph(fn, reps=reps, warmup=1)["median_ms"]
    except RuntimeError:
        return time_eager(fn, reps=reps, warmup=0)["median_ms"]


def tune(sms: int, heads_list, nodes_list, configs) -> dict:
    """Best prefix-kernel config per (heads, W) at one representative shape (bs 4, prefix 8k)."""
    best = {}
    for heads in heads_list:
        for n_nodes in nodes_list:
            p = make_problem(4, 8192, n_nodes, heads, seed=3)
            timings = {}
            for cfg in configs:
                try:
                    att = SplitTreeAttention(p, cfg, sms)
                    timings[cfg.label()] = _time(lambda att=att: att._launch_partial(False, False))
                except Exception as exc:  # out of resources and the like: skip the config
                    timings[cfg.label()] = None
                    print(
                        f"[mla] tune {cfg.label()} heads={heads} W={n_nodes}: {type(exc).__name__}",
                        flush=True,
                    )
            ok = {k: v for k, v in timings.items() if v is not None}
            label = min(ok, key=ok.get) if ok else configs[0].label()
            best[(heads, n_nodes)] = next(c for c in configs if c.label() == label)
            print(f"[mla] tune heads={heads} W={n_nodes}: {timings} -> {label}", flush=True)
    return best


def run_sweep(
    args, copy_gbs: float, mm_tflops: float, sms: int, into: dict | None = None, on_row=None
) -> dict:
    nodes_list = [b + 1 for b in args.budgets]
    t0 = time.time()
    checks = check(CANDIDATE_CONFIGS if args.check_all_configs else CANDIDATE_CONFIGS[:2], sms)
    done = [c for c in checks if c["ok"] is not None]
    print(f"[mla] checks: {sum(c['ok'] for c in done)}/{len(done)} ok ({time.time() - t0:.0f} s)", flush=True)
    best = tune(sms, args.heads, nodes_list, CANDIDATE_CONFIGS)
    rows = []
    res = {} if into is None else into
    res.update(checks=checks, tuned={f"H{h}_W{w}": c.label() for (h, w), c in best.items()}, rows=rows)
    for heads in args.heads:
        for n_nodes in nodes_list:
            for bs in args.bs:
                for L in args.prefix:
                    fl_pre, fl_tail = attention_flops(bs, L, n_nodes, heads)
                    if fl_pre > args.max_flops:
                        continue
                    p = make_problem(bs, L, n_nodes, heads, seed=bs * 7 + L)
                    cfg = best[(heads, n_nodes)]
                    att = SplitTreeAttention(p, cfg, sms)
                    r = {"heads": heads, "n_nodes": n_nodes, "budget": n_nodes - 1, "bs": bs, "prefix": L,
                         "config": cfg.label(), "n_splits": att.n_splits}  # fmt: skip
                    r["split_ms"] = _time(att)
                    r["prefix_ms"] = _time(lambda att=att: att._launch_partial(False, False))
                    r["tail_ms"] = _time(lambda att=att: att._launch_partial(True, False))
                    r["merge_ms"] = _time(att.combine)
                    if heads == 8 and n_nodes in (1, 17) and L >= 8192:
                        # What bounds the prefix pass: the same launch with index arithmetic instead
                        # of the per-token gather through kv_indices (valid here: slots are consecutive).
                        r["prefix_contig_ms"] = _time(lambda att=att: att._launch_partial(False, True))
                        r["prefix_contig_bw_frac"] = (
                            prefix_bytes(bs, L) / (r["prefix_contig_ms"] / 1e3) / 1e9 / copy_gbs
                        )
                    naive_elems = bs * heads * n_nodes * (L + n_nodes)
                    r["naive_ms"] = _time(lambda p=p: naive_tree_attention(p)) if naive_elems <= args.max_naive_elems else None  # fmt: skip
                    pb = prefix_bytes(bs, L)
                    part = 2 * bs * (att.n_splits + 1) * att.rows * (D_LATENT * 2 + 4)
                    r.update(prefix_bytes=pb, io_bytes=io_bytes(bs, n_nodes, heads), partial_bytes=part,
                             prefix_flops=fl_pre, tail_flops=fl_tail)  # fmt: skip
                    r["prefix_gbs"] = pb / (r["prefix_ms"] / 1e3) / 1e9
                    r["prefix_bw_frac"] = r["prefix_gbs"] / copy_gbs
                    r["prefix_tflops"] = fl_pre / (r["prefix_ms"] / 1e3) / 1e12
                    r["prefix_mm_frac"] = r["prefix_tflops"] / mm_tflops
                    rf = roofline(pb, fl_pre, copy_gbs, mm_tflops)
                    r["prefix_floor_ms"], r["prefix_bound"] = rf["floor_ms"], rf["bound"]
                    r["prefix_roofline_frac"] = rf["floor_ms"] / r["prefix_ms"]
                    r["total_gbs"] = (pb + r["io_bytes"]) / (r["split_ms"] / 1e3) / 1e9
                    r["speedup_vs_naive"] = r["naive_ms"] / r["split_ms"] if r["naive_ms"] else None
                    rows.append(r)
                    if on_row:
                        on_row()
                    print(
                        f"[mla] H={heads:2d} W={n_nodes:2d} bs={bs:2d} L={L:5d} split {r['split_ms']:.3f} ms "
                        f"(prefix {r['prefix_ms']:.3f}: {100 * r['prefix_bw_frac']:.0f}% copy BW, "
                        f"{100 * r['prefix_mm_frac']:.0f}% mm, {r['prefix_bound']}-bound) naive "
                        + (f"{r['naive_ms']:.3f}" if r["naive_ms"] else "skipped"),
                        flush=True,
                    )
                    del att, p
    return res


def render_markdown(res: dict) -> str:
    from sglang_ddtree.bench._stamp import md_table, stamp_markdown

    done = [c for c in res["checks"] if c["ok"] is not None]
    ok = sum(c["ok"] for c in done)
    worst = max(done, key=lambda c: c["rel_err_split"])
    out = [
        "# Tree-verify attention at Kimi K2.6 MLA shapes",
        "",
        stamp_markdown(res["stamp"]),
        "",
        f"Ceilings measured in this run: copy **{res['copy_gbs']:.0f} GB/s**, bf16 matmul "
        f"**{res['matmul_tflops']:.0f} TFLOP/s**. Absorbed MLA (576-wide latent+rope keys, 512-wide values), "
        f"W = budget + 1 tree nodes per request, ancestor mask; times are CUDA-graph medians.",
        "",
        f"Numerics: {ok}/{len(done)} checks pass (split vs float32 reference < 1e-2, split vs naive "
        f"< 2e-2, every element written); worst split error {worst['rel_err_split']:.1e} "
        f"(H={worst['heads']}, W={worst['n_nodes']}, L={worst['prefix']}), naive bf16 error up to "
        f"{max(c['rel_err_naive'] for c in done):.1e}"
        + (
            f"; {len(res['checks']) - len(done)} config(s) did not compile"
            if len(done) < len(res["checks"])
            else ""
        )
        + ".",
        "",
        "Tuned prefix-kernel configs: " + ", ".join(f"{k}: {v}" for k, v in res["tuned"].items()),
        "",
    ]
    for heads in sorted({r["heads"] for r in res["rows"]}):
        out += [
            f"## {heads} heads per GPU" + (" (TP-8 shard)" if heads == 8 else " (all heads on one GPU)"),
            "",
        ]
        rows = [
            [r["budget"], r["bs"], r["prefix"], r["split_ms"], r["prefix_ms"], r.get("tail_ms", "-"), r["merge_ms"],
             r["naive_ms"] if r["naive_ms"] else "-", f"{r['speedup_vs_naive']:.1f}x" if r["speedup_vs_naive"] else "-",
             f"{100 * r['prefix_bw_frac']:.0f}%", f"{100 * r['prefix_mm_frac']:.0f}%", r["prefix_bound"],
             f"{100 * r['prefix_roofline_frac']:.0f}%"]
            for r in res["rows"] if r["heads"] == heads
        ]  # fmt: skip
        out.append(md_table(
            ["budget", "bs", "prefix", "split ms", "prefix ms", "tail ms", "merge ms", "naive ms", "split speedup",
             "prefix of copy BW", "prefix of mm rate", "prefix bound", "prefix of roofline"], rows))  # fmt: skip
        out.append("")
    probe = [r for r in res["rows"] if "prefix_contig_ms" in r]
    if probe:
        out += [
            "## What bounds the memory-bound prefix pass: gather vs consecutive slots (8 heads)",
            "",
            md_table(
                [
                    "budget",
                    "bs",
                    "prefix",
                    "prefix ms (gather)",
                    "of copy BW",
                    "prefix ms (consecutive)",
                    "of copy BW",
                ],
                [
                    [
                        r["budget"],
                        r["bs"],
                        r["prefix"],
                        r["prefix_ms"],
                        f"{100 * r['prefix_bw_frac']:.0f}%",
                        r["prefix_contig_ms"],
                        f"{100 * r['prefix_contig_bw_frac']:.0f}%",
                    ]
                    for r in probe
                ],
            ),  # fmt: skip
            "",
        ]
    return "\n".join(out)


def plot(res: dict, path) -> object:
    """Prefix pass against its roofline (copy bandwidth or bf16 matmul rate, whichever binds)."""
    from sglang_ddtree.bench._stamp import plot_lines

    series = {}
    for r in res["rows"]:
        if r["bs"] != 16 and not (r["heads"] == 64 and r["bs"] == 4):
            continue
        key = f"H={r['heads']} bs={r['bs']} budget {r['budget']} ({r['prefix_bound']})"
        xs, ys = series.setdefault(key, ([], []))
        xs.append(r["prefix"])
        ys.append(100 * r["prefix_roofline_frac"])
    return plot_lines(
        path,
        series,
        title=f"Tree-verify prefix pass, % of its roofline floor ({res['stamp'].get('device')})",
        xlabel="prefix length",
        ylabel="% of roofline (max of bytes/copy BW, FLOP/matmul rate)",
        hlines={"70%": 70.0},
    )


def main(argv: Sequence[str] | None = None) -> int:
    from sglang_ddtree.bench import _stamp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="mla_tree_attention")
    ap.add_argument("--heads", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 16, 32, 64])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--prefix", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument(
        "--max-flops", type=float, default=2e12, help="skip shapes whose prefix pass exceeds this"
    )
    ap.add_argument("--max-naive-elems", type=float, default=1.1e9, help="skip naive above this score count")
    ap.add_argument("--check-all-configs", action="store_true")
    args = ap.parse_args(argv)

    st = _stamp.stamp()
    copy_gbs = _stamp.copy_bandwidth_gbs()
    mm = _stamp.matmul_tflops()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"[mla] {st.get('device')}: copy {copy_gbs:.0f} GB/s, matmul {mm:.0f} TFLOP/s", flush=True)
    res = {"stamp": st, "copy_gbs": copy_gbs, "matmul_tflops": mm, "args": vars(args)}
    out_dir = _stamp.results_dir(args.out)
    run_sweep(
        args,
        copy_gbs,
        mm,
        sms,
        into=res,
        on_row=lambda: _stamp.write_json(out_dir / f"{args.name}.json", res),
    )
    paths = _stamp.write_outputs(out_dir, args.name, res, render_markdown(res))
    png = plot(res, out_dir / f"{args.name}.png")
    print("[mla] wrote", [str(p) for p in paths + ([png] if png else [])], flush=True)
    return 0 if all(c["ok"] is not False for c in res["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
