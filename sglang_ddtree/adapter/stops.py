"""A round ends a request exactly where plain decoding would have ended it.

SGLang 0.5.23 checks a speculative round's ``n`` accepted tokens in one call,
``Req.update_finish_state(n)``, and that call is not what ``n`` one-token calls
would do: it walks the stop strings in list order over the whole tail and ends the
request at the first *listed* string it finds, not at the earliest one in the text,
and it tries stop strings before stop token ids, so a stop token earlier in the
round loses to a stop string after it. Plain decoding sees one token a step and
ends at the earliest match; stock DFLASH and EAGLE inherit the late end.

Under DDTREE a round whose request has stop strings or stop regexes is checked the
way plain decoding checks it: SGLang's own one-token check on each prefix of the
round in turn, first to last, stopping at the first that finishes the request. The
finish reason, ``finished_len`` (so the emitted tokens and text, trimmed or not) are
then plain's. Requests without text stops keep the one call: its token checks
already find the earliest stop id, and it costs one decode less per token.
"""

from __future__ import annotations

import functools


def update_finish_state_like_plain(original, req, new_accepted_len: int = 1):
    """``Req.update_finish_state`` with the round's tokens checked one prefix at a time."""
    if new_accepted_len <= 1 or not _has_text_stops(req) or not _serving_ddtree():
        return original(req, new_accepted_len)
    ids = req.output_ids
    unseen = ids[len(ids) - new_accepted_len + 1 :]
    del ids[len(ids) - len(unseen) :]  # the round's first token stays: checked first
    grammar = req.grammar
    try:
        while True:
            # The grammar has consumed the whole round: its end is checked with the last token.
            req.grammar = None if unseen else grammar
            original(req, 1)
            if req.finished() or not unseen:
                break
            ids.append(unseen.pop(0))
    finally:
        req.grammar = grammar
        ids.extend(unseen)


def _has_text_stops(req) -> bool:
    params = req.sampling_params
    return bool(params.stop_strs) or bool(getattr(params, "stop_regex_strs", None))


@functools.cache
def _serving_ddtree() -> bool:
    """Stock algorithms keep SGLang's own check (the plugin may be loaded beside them).
    Asked first inside a scheduler's result processing, where the spec is set."""
    from .requests import serving_ddtree

    return serving_ddtree()


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.Req.update_finish_state",
        update_finish_state_like_plain,
        HookType.AROUND,
    )
