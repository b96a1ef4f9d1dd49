"""Per-request admission checks for DDTREE.

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


def install() -> None:
    """Wrap the DFlash-family admission check the scheduler runs for every request."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

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
