"""Per-request admission checks.

Two checks for every server the plugin is loaded in (plain ones included), in
the tokenizer manager, where a refusal is an HTTP 400: an empty prompt and a
token id outside the vocabulary reach SGLang's scheduler unchecked and kill it
(an IndexError in the logits processor, an out-of-range embedding lookup).

The rest is for DDTREE.

A tree round verifies every depth in one forward, so any sampling feature whose
effect on token ``t+1`` depends on the tokens drafted at ``t`` cannot be applied
exactly to the whole tree: SGLang applies penalties, ``min_new_tokens`` and custom
logit processors once per round, identically to every position. DDTREE refuses
such requests with a clear message instead of silently leaving the target
distribution. Grammar-constrained decoding is not wired for trees yet.
"""

from __future__ import annotations


def ddtree_request_error(req) -> str | None:
    params = req.sampling_params
    if any(getattr(params, name, None) for name in ("json_schema", "regex", "ebnf", "structural_tag")):
        return (
            "DDTREE speculative decoding does not support constrained decoding (json_schema/regex/ebnf) yet."
        )
    if (params.frequency_penalty or 0.0) != 0.0 or (params.presence_penalty or 0.0) != 0.0:
        return (
            "DDTREE speculative decoding refuses frequency/presence penalties: they depend on tokens "
            "drafted within the same verify round and would not be applied exactly."
        )
    if (params.repetition_penalty or 1.0) != 1.0:
        return "DDTREE speculative decoding refuses repetition_penalty (not exact under tree verification)."
    if (getattr(params, "min_new_tokens", 0) or 0) > 0:
        return "DDTREE speculative decoding refuses min_new_tokens (not exact under tree verification)."
    if getattr(req, "custom_logit_processor", None):
        return (
            "DDTREE speculative decoding refuses custom logit processors (not exact under tree verification)."
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
        if error is None and _serving_ddtree():
            error = ddtree_request_error(req)
        return error

    HookRegistry.register("sglang.srt.managers.scheduler.validate_dflash_request", validate, HookType.AROUND)


def _serving_ddtree() -> bool:
    from sglang.srt.runtime_context import get_spec

    try:
        return str(get_spec().speculative_algorithm or "").upper() == "DDTREE"
    except Exception:
        return False
