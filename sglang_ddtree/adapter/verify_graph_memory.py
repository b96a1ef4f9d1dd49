"""Graph memory the target's verify graphs never use.

SGLang 0.5.23's triton backend sizes its CUDA-graph state for decode and verify alike
(``TritonAttnBackend.init_cuda_graph_state``), per graph token (``max_bs x width``):

* kv indices of ``max_bs x width x context`` int64, where a verify fills one prefix per request
  (``_fill_kv_indptr_and_indices``: ``sum(seq_lens)`` entries, at most ``max_bs x context``);
* a split-KV decode scratch of ``[max_bs x width, heads, max_kv_splits, v_head_dim]`` float32
  and its lse, which a verify never reads (its graph metadata passes ``attn_logits=None``:
  ``_build_cuda_graph_forward_metadata``).

The target of a DDTREE server captures verify graphs only. On the K2.6 rank (262,144-token
context, 8 MLA heads, 256 splits, 512 latent columns) that is 2 MB of indices and 4 MB of
scratch per graph token: 3.4 GB for budget 16's graphs up to bs 32, 13 GB for budget 64's, and
per GPU of the TP-8 service at bs 128 and budget 16, 13.7 GB. The target's backends get kv
indices sized for one prefix per request (:func:`size_kv_indices_for_verify`), and the scratch
is given back after capture (:func:`release_decode_scratch`).
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


def size_kv_indices_for_verify(backend) -> None:
    """Give this target backend's graph state kv indices for one prefix (and a verify width)
    per request, instead of one per graph token; a buffer SGLang passes in is kept."""
    init = backend.init_cuda_graph_state

    def init_cuda_graph_state(max_bs, max_num_tokens, kv_indices_buf=None, cuda_graph_num_kv_splits_buf=None):
        if kv_indices_buf is None:
            width = -(-int(max_num_tokens) // int(max_bs))
            entries = int(max_bs) * (int(backend.max_context_len) + width)
            kv_indices_buf = torch.zeros(entries, dtype=torch.int64, device=backend.device)
        init(max_bs, max_num_tokens, kv_indices_buf, cuda_graph_num_kv_splits_buf)

    backend.init_cuda_graph_state = init_cuda_graph_state


def install() -> None:
    """Size the kv indices of every target triton backend of a DDTREE server (the start-up one
    and each verify width's) as :func:`size_kv_indices_for_verify` does."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from ..config import serving_ddtree

    def after(result, backend, model_runner, *args, **kwargs):
        if serving_ddtree(getattr(model_runner, "spec_algorithm", None)) and not model_runner.is_draft_worker:
            size_kv_indices_for_verify(backend)
        return result

    HookRegistry.register(
        "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__", after, HookType.AFTER
    )
