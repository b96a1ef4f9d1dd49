"""Pure-torch CPU versions of the ``torch.ops.sgl_kernel`` ops SGLang's
speculative path calls on CPU, for machines where ``sgl_kernel``'s compiled
library cannot load. Semantics follow SGLang's Triton kernels of the same names
(``assign_req_to_token_pool``, ``assign_extend_cache_locs``,
``copy_all_layer_kv_cache_tiled``).
"""

from __future__ import annotations

import ctypes
import logging

import torch

logger = logging.getLogger("sglang_ddtree.cpu")

_LIB: torch.library.Library | None = None


def _segments(start_offset: torch.Tensor, end_offset: torch.Tensor):
    """(request, start, end, offset into the flat buffer) per request."""
    starts, ends = start_offset.tolist(), end_offset.tolist()
    offset = 0
    for i, (s, e) in enumerate(zip(starts, ends)):
        yield i, s, e, offset
        offset += e - s


def assign_req_to_token_pool(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """``req_to_token[row, start:end] = out_cache_loc[offset: offset + end - start]``."""
    rows = req_pool_indices.tolist()
    for i, s, e, off in _segments(start_offset, end_offset):
        req_to_token[rows[i], s:e] = out_cache_loc[off : off + e - s].to(req_to_token.dtype)


def assign_extend_cache_locs(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """``out_cache_loc[offset: offset + end - start] = req_to_token[row, start:end]``."""
    rows = req_pool_indices.tolist()
    for i, s, e, off in _segments(start_offset, end_offset):
        out_cache_loc[off : off + e - s] = req_to_token[rows[i], s:e].to(out_cache_loc.dtype)


def copy_all_layer_kv_cache(data_ptrs, strides, tgt_loc, src_loc):
    """For every buffer (raw pointer + row stride in bytes) copy row ``src`` to ``tgt``."""
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in zip(tgt_loc.tolist(), src_loc.tolist()):
            if tgt != src:
                ctypes.memmove(ptr + tgt * stride, ptr + src * stride, stride)


_MASK32 = 0xFFFFFFFF


def _rotl32(x, r: int):
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _murmur3_mix(h, k):
    k = (k * 0xCC9E2D51) & _MASK32
    k = _rotl32(k, 15)
    k = (k * 0x1B873593) & _MASK32
    h = h ^ k
    h = _rotl32(h, 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def _fmix32(h):
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def murmur_hash32(seed, positions, col_indices):
    """MurmurHash3 of (seed low, seed high, position, column) per cell, as SGLang's
    Triton ``murmur_hash32_kernel``: ``[rows]`` x ``[cols]`` -> ``[rows, cols]`` uint32.
    int64 products wrap modulo 2**64, which keeps the low 32 bits exact."""
    seed = seed.to(torch.int64)
    h = torch.zeros_like(seed)
    h = _murmur3_mix(h, seed & _MASK32)
    h = _murmur3_mix(h, (seed >> 32) & _MASK32)
    h = _murmur3_mix(h, positions.to(torch.int64) & _MASK32)
    h = _murmur3_mix(h[:, None], (col_indices.to(torch.int64) & _MASK32)[None, :])
    return _fmix32(h ^ 16).to(torch.uint32)


_OPS = {
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor out_cache_loc, int pool_len) -> ()",
        assign_req_to_token_pool,
    ),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor(a!) out_cache_loc, int pool_len) -> ()",
        assign_extend_cache_locs,
    ),
    "murmur_hash32_cpu": ("(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor", murmur_hash32),
    "copy_all_layer_kv_cache_cpu": (
        "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
        copy_all_layer_kv_cache,
    ),
}


def register_cpu_ops() -> None:
    """Register the ops under ``torch.ops.sgl_kernel`` unless something already has."""
    global _LIB
    if _LIB is not None:
        return
    missing = [name for name in _OPS if not _op_exists(name)]
    if not missing:
        return
    _LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in missing:
        schema, fn = _OPS[name]
        _LIB.define(name + schema)
        _LIB.impl(name, fn, "CPU")
    logger.info("CPU mode: registered pure-torch sgl_kernel ops %s", ", ".join(missing))


def _op_exists(name: str) -> bool:
    try:
        getattr(torch.ops.sgl_kernel, name)
        return True
    except (AttributeError, RuntimeError):
        return False
