"""Graph memory the target's verify graphs never read, given back after capture.

SGLang 0.5.23's triton backend sizes its CUDA-graph state for decode and verify alike
(``TritonAttnBackend.init_cuda_graph_state``): besides the kv indices, a split-KV decode
scratch of ``[max_bs x width, heads, max_kv_splits, v_head_dim]`` float32 and its lse. A
verify forward never reads the scratch (its graph metadata passes ``attn_logits=None``:
``_build_cuda_graph_forward_metadata``), and the target of a DDTREE server captures verify
graphs only. On the K2.6 rank (8 MLA heads, 256 splits, 512 latent columns) the scratch is 4 MB
per graph token: 2.2 GB for budget 16's graphs up to bs 32, 8.7 GB for budget 64's.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("sglang_ddtree")

DECODE_SCRATCH = ("cuda_graph_attn_logits", "cuda_graph_attn_lse")


def verify_only(target_runner) -> bool:
    """Whether the target's captured graphs are target-verify graphs (a speculative target)."""
    graphs = getattr(target_runner, "decode_cuda_graph_runner", None)
    mode = getattr(graphs, "capture_forward_mode", None)
    return getattr(mode, "name", None) == "TARGET_VERIFY"


def release_decode_scratch(target_runner, backends) -> float:
    """Replace the decode scratch of every target attention backend in ``backends`` (the
    start-up one and each verify width's, which may view it) by empty tensors, where the
    target's graphs are verify graphs; returns the GB released."""
    if not verify_only(target_runner):
        return 0.0
    storages = {}
    for backend in {id(b): b for b in backends if b is not None}.values():
        for name in DECODE_SCRATCH:
            scratch = getattr(backend, name, None)
            if isinstance(scratch, torch.Tensor) and scratch.numel():
                storage = scratch.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
                setattr(backend, name, scratch.new_empty((0, *scratch.shape[1:])))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    released = sum(storages.values()) / 2**30
    if released:
        logger.info("DDTREE: released %.2f GB of decode scratch the verify graphs never read", released)
    return released
