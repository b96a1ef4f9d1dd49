"""Per-request admission checks for DDTREE.

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
