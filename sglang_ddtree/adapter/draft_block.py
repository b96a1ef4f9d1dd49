"""The drafter's forward batch of a DDTREE round (``DDTreeWorker._draft``)."""

from __future__ import annotations

import torch
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.speculative.dflash_worker_v2 import _resolve_dflash_embedding_module
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from .verify_input import draft_seq_lens_cpu


def draft_forward_batch(worker, batch, draft_input, roots, prefix_lens, plan) -> ForwardBatch:
    """The drafter's forward of one round: each request's block (its root, then mask tokens)
    at the positions after its prefix, written to the round's window (``plan``)."""
    bs, block = len(prefix_lens), worker.block_size
    block_ids = torch.full((bs, block), int(worker._mask_token_id), dtype=torch.int64, device=worker.device)
    block_ids[:, 0] = roots
    positions = (prefix_lens[:, None].to(torch.int64) + worker._block_pos_offsets).reshape(-1)
    positions.clamp_(max=worker._last_position)
    target_model = worker.target_worker.model_runner.model
    embed = unwrap_lora_layer(_resolve_dflash_embedding_module(worker.draft_model, target_model))
    embeds = embed(block_ids)
    if worker._noise_embed_scale != 1.0:
        embeds = embeds * worker._noise_embed_scale
    seq_lens_cpu = draft_seq_lens_cpu(batch, draft_input, bs, worker.block_size)
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        batch_size=bs,
        input_ids=block_ids.flatten(),
        req_pool_indices=batch.req_pool_indices,
        seq_lens=prefix_lens,
        out_cache_loc=None,
        seq_lens_sum=int(seq_lens_cpu.sum()),
        seq_lens_cpu=seq_lens_cpu,
        positions=positions,
        input_embeds=embeds.view(-1, embeds.shape[-1]),
        spec_algorithm=SpeculativeAlgorithm.DFLASH,
        spec_info=worker._draft_block_spec_info,
        capture_hidden_mode=CaptureHiddenMode.NULL,
        global_num_token_non_padded_cpu=bs * block,
        can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
    )
    plan.bind(forward_batch, worker.draft_model_runner.kv_index_translator, cols=slice(0, block))
    return forward_batch
