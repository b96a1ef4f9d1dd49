"""The target's token for every tree slot: the ``posterior`` the accept walk follows.

Greedy requests take the argmax. Sampled requests take one sample per slot from
the target's distribution, drawn by SGLang's own sampler (same temperature,
top-k / top-p / min-p filters, backend and per-request seeds as non-speculative
decoding), with every slot's position passed as its sampling position. Along an
accepted path each depth has a distinct position, so a seeded request draws the
same variates position by position as it would without speculation.
"""

from __future__ import annotations

import dataclasses

import torch


def _repeat_rows(tensor, width: int):
    return None if tensor is None else torch.repeat_interleave(tensor, width, dim=0)


def expand_sampling_info(sampling_info, width: int):
    """A copy of ``sampling_info`` with every per-request row repeated ``width``
    times (one row per tree slot). Logit adjustments must already be applied."""
    return dataclasses.replace(
        sampling_info,
        temperatures=_repeat_rows(sampling_info.temperatures, width),
        top_ps=_repeat_rows(sampling_info.top_ps, width),
        top_ks=_repeat_rows(sampling_info.top_ks, width),
        min_ps=_repeat_rows(sampling_info.min_ps, width),
        sampling_seed=_repeat_rows(sampling_info.sampling_seed, width),
        grammars=None,
        grammar_mask=None,
        penalizer_orchestrator=None,
        acc_additive_penalties=None,
        acc_scaling_penalties=None,
        has_custom_logit_processor=False,
        custom_params=None,
        custom_logit_processor=None,
        logit_bias=None,
        return_sampling_masks=None,
        return_sampling_support_logprobs=None,
        sampling_mask_batch_indices=None,
        sampling_support_logprobs_capture_indices=None,
        watermark_keys=None,
        watermark_context_windows=None,
        watermark_enabled=None,
        watermark_candidates_host=None,
        has_watermark_candidates=False,
    )


def tree_posterior(
    logits: torch.Tensor,  # [bs * width, vocab], adjusted
    sampling_info,
    positions: torch.Tensor,  # [bs * width]
    width: int,
    sampler,
) -> torch.Tensor:
    """``[bs * width]`` int64: argmax, or one target sample per slot."""
    if sampling_info is None or sampling_info.is_all_greedy:
        return torch.argmax(logits, dim=-1)
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    expanded = expand_sampling_info(sampling_info, width)
    output = LogitsProcessorOutput(next_token_logits=logits.clone())
    ids = sampler(output, expanded, False, [], [], positions)
    return ids.to(torch.int64)
