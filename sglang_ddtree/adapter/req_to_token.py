"""Width of the ``req_to_token`` rows under DDTREE.

Every decode round the DFlash V2 scheduler path (``DFlashDraftInputV2.
prepare_for_decode``) reserves ``2 * speculative_num_draft_tokens`` slots past a
request's committed length (page-aligned): one verify window for the round in
flight whose results the overlap scheduler has not read back yet, one for the
next round. The worker then reads its ``budget + 1`` window from the row.

SGLang 0.5.23 widens the row for that reservation only when ``page_size > 1``
(``get_req_to_token_extra_context_len``); at page size 1 the row has
``context_len + 4 + num_draft_tokens`` slots, so a request ending within about one
verify width of the context limit makes the reservation run past its row: the CPU
path fails a shape check and kills the scheduler, the GPU path's Triton kernel
writes past the row (into the next request's row, or past the tensor). With
DDTREE's verify width (``budget + 1``, 33 by default) the window is wide.

The reservation itself is right (the verify window of a request still in flight
may start up to one round past its committed length); the row is too narrow. The
hook below gives the row the headroom SGLang already gives it at page size > 1:
the reservation plus a page's rounding, for every page size.
See patches/0004-req-to-token-row-width.md.
"""

from __future__ import annotations

TARGET = "sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len"


def reservation_headroom(num_draft_tokens: int, page_size: int) -> int:
    """Slots past the context length a row needs for the decode reservation."""
    return 2 * int(num_draft_tokens) + int(page_size) - 1


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .requests import serving_ddtree

    def extra_context_len(original, *args, **kwargs):
        extra = original(*args, **kwargs)
        if not serving_ddtree():
            return extra
        from sglang.srt.mem_cache.allocation_sizing import get_alloc_page_size
        from sglang.srt.runtime_context import max_speculative_num_draft_tokens

        width = max_speculative_num_draft_tokens() or 0
        return max(extra, reservation_headroom(width, get_alloc_page_size()))

    HookRegistry.register(TARGET, extra_context_len, HookType.AROUND)
