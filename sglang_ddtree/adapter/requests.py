"""Per-request admission checks.

Two checks for every server the plugin is loaded in (plain ones included), in
the tokenizer manager, where a refusal is an HTTP 400: an empty prompt and a
token id outside the vocabulary reach SGLang's scheduler unchecked and kill it
(an IndexError in the logits processor, an out-of-range embedding lookup).

The rest is for DDTREE.

Grammar (json_schema, regex, EBNF, structural tags), frequency / presence /
repetition penalties, ``min_new_tokens``, ``logit_bias`` and custom logit
processors are served under a tree (``request_features.py``; the semantics per
feature are in docs/features.md). What a tree cannot serve is refused here, per
request, with a message that names the feature, before the request is scheduled.
"""

from __future__ import annotations


def ddtree_request_error(req) -> str | None:
    if getattr(req, "return_sampling_mask", False):
        return (
            "DDTREE speculative decoding does not support return_sampling_mask: "
            "the sampling-mask capture is defined for a chain verify block."
        )
    return None


def input_ids_error(input_ids, vocab_size: int) -> str | None:
    """Why a tokenized prompt cannot be served, or None."""
    if input_ids is None:
        return None
    if len(input_ids) == 0:
        return "The prompt is empty: give at least one token (text or input_ids)."
    bad = next((t for t in input_ids if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
        return f"input_ids contains token id {bad}, outside the model's vocabulary [0, {vocab_size})."
    return None


def _plain_token_prompt(obj) -> bool:
    """A generation prompt made of token ids only (no embeddings or media, whose
    placeholder ids follow other rules)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    media = ("input_embeds", "image_data", "video_data", "audio_data", "positional_embed_overrides")
    return isinstance(obj, GenerateReqInput) and all(getattr(obj, name, None) is None for name in media)


def install() -> None:
    """Wrap the tokenizer manager's request validation (every server) and the
    DFlash-family admission check the scheduler runs for every request (DDTREE)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def validate_prompt(original, manager, obj, input_ids, *args, **kwargs):
        if _plain_token_prompt(obj):
            error = input_ids_error(input_ids, int(manager.model_config.vocab_size))
            if error is not None:
                raise ValueError(error)
        return original(manager, obj, input_ids, *args, **kwargs)

    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        validate_prompt,
        HookType.AROUND,
    )

    def validate(original, req, enable_overlap, *args, **kwargs):
        error = original(req, enable_overlap, *args, **kwargs)
        if error is None and serving_ddtree():
            error = ddtree_request_error(req)
        return error

    HookRegistry.register("sglang.srt.managers.scheduler.validate_dflash_request", validate, HookType.AROUND)


def serving_ddtree() -> bool:
    from sglang.srt.runtime_context import get_spec

    try:
        return str(get_spec().speculative_algorithm or "").upper() == "DDTREE"
    except Exception:
        return False
