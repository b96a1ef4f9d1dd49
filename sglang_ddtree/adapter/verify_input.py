"""The verify input of a DDTree round, as SGLang's attention backends see it.

``SpecInputType`` is a closed enum, so DDTree reuses ``DFLASH_VERIFY`` on purpose:
every backend path that accepts a DFlash verify (target-verify forward of a fixed
width per request, CUDA-graph capture at that width) accepts this one. What a
chain verify lacks is the tree mask, carried in two forms:

* ``tree_visibility`` ``[bs, width, width]`` bool - read by the torch_native
  verify forward (``adapter/attention/torch_native.py``);
* ``custom_mask`` - SGLang's flat per-request ``[width, prefix + width]`` allow
  mask, read by the GPU backends' custom-mask verify paths.

``topk`` stays 1: backends that gate EAGLE tree metadata on ``topk > 1`` must not
build EAGLE topology for a DDTree.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from sglang.srt.speculative.dflash_info import DFlashVerifyInput


@dataclass
class DDTreeVerifyInput(DFlashVerifyInput):
    tree_visibility: torch.Tensor | None = None  # [bs, width, width] bool


@contextlib.contextmanager
def borrowed(batch, **fields):
    """``batch`` (SGLang's schedule batch) with ``fields`` set for a forward batch built from it,
    and its own values back after: the scheduler reads them again after the step."""
    held = {name: getattr(batch, name) for name in fields}
    for name, value in fields.items():
        setattr(batch, name, value)
    try:
        yield batch
    finally:
        for name, value in held.items():
            setattr(batch, name, value)


def prefix_lens_bound_cpu(batch, draft_input, context_len: int):
    """Each request's prefix length on the host, or an upper bound of it; None when neither
    is known there. Under the overlap scheduler a backend that opts out of host lengths
    (triton: ``needs_cpu_seq_lens``) leaves ``seq_lens_cpu`` unset, and reading the device
    lengths would stall the host every round. The round's KV reservation
    (``nxt_kv_lens_cpu``) holds every verify slot, so it is at least the prefix; a prefix
    never reaches the context length, so the bound is clamped there (the CUDA-graph mask
    buffer is sized for it)."""
    if batch.seq_lens_cpu is not None:
        return batch.seq_lens_cpu
    reserved = draft_input.nxt_kv_lens_cpu
    if reserved is None:
        return None
    return reserved[: len(batch.seq_lens)].clamp(max=context_len)


def draft_seq_lens_cpu(batch, draft_input, bs: int, block_size: int):
    """Host upper bound of each request's KV length during the draft forward."""
    if batch.seq_lens_cpu is not None:
        return batch.seq_lens_cpu[:bs].to(torch.int32) + block_size
    if draft_input.nxt_kv_lens_cpu is not None:
        return draft_input.nxt_kv_lens_cpu[:bs].to(torch.int32)
    return torch.tensor([req.kv.kv_allocated_len for req in batch.reqs], dtype=torch.int32)
