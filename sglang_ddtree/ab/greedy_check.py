"""The A/B tool's greedy side-check: every server's greedy outputs against the baseline's first
server's, a divergence at a bf16 near-tie of the reference's own decode step told apart from a real
one (a wrong tree or a stale KV entry misses by whole nats)."""

from __future__ import annotations

from .arms import Arm

# A divergence from plain whose token plain's own decode step put within this many nats of its
# argmax is bf16 rounding (a near-tie flipped); a wrong tree or a stale KV entry misses by whole
# nats. The GPU serving suite holds its bf16 arms to the same margin.
BF16_MARGIN = 0.25


def greedy_check(
    arms: list[Arm], baseline: str, prompts: list, tokens: int, allowed: bool, margin: float = 0.0
) -> dict:
    """Every server's greedy outputs against the baseline's first server's; with ``margin`` and
    the reference's two best log-probs per token, a divergence at a near-tie (the arm's token
    within ``margin`` nats of the reference's argmax there) is reported but is no failure."""
    checked = [(a, s) for a in arms for s in a.servers if s.get("greedy") is not None]
    result = {
        "prompts": prompts,
        "max_new_tokens": tokens,
        "arms_checked": list(dict.fromkeys(a.name for a, _ in checked)),
        "servers_checked": len(checked),
        "reference": None,
        "mismatches": [],
        "margin": margin,
        "near_ties": 0,
        "ok": True,
        "message": "",
    }
    if not prompts:
        result["message"] = "greedy check off (--check-prompts 0)"
        return result
    if len(checked) < 2:
        result["message"] = "fewer than two servers answered the greedy prompts: nothing to compare"
        return result
    ref_arm, ref = next(((a, s) for a, s in checked if a.name == baseline), checked[0])
    result["reference"] = ref_arm.name
    # without them (margin 0, or a reference that is not the baseline) a divergence's gap is unknown
    result["reference_logprobs"] = bool(ref.get("greedy_top2"))
    for arm, server in checked:
        if server is ref:
            continue
        for i, (want, got) in enumerate(zip(ref["greedy"], server["greedy"])):
            if want == got:
                continue
            first = next((k for k, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
            gap = _divergence_gap(ref.get("greedy_top2"), i, first, got)
            result["mismatches"].append(
                {
                    "arm": arm.name,
                    "start": server["start"],
                    "prompt_index": i,
                    "prompt": prompts[i] if isinstance(prompts[i], str) else f"{len(prompts[i])} token ids",
                    "first_diff_token": first,
                    "reference_ids": want[first : first + 8],
                    "arm_ids": got[first : first + 8],
                    "gap": gap,
                    "near_tie": gap is not None and gap <= margin,
                }
            )
    failures = [m for m in result["mismatches"] if not m["near_tie"]]
    result["near_ties"] = len(result["mismatches"]) - len(failures)
    same = (
        f"in {', '.join(result['arms_checked'])} ({len(checked)} servers, {len(prompts)} prompts x "
        f"{tokens} tokens, temperature 0)"
    )
    if failures:
        result["ok"] = False
        parts = [
            f"{m['arm']}{' start ' + str(m['start'] + 1) if m['start'] else ''} prompt {m['prompt_index']} "
            f"diverges from {ref_arm.name} at token {m['first_diff_token']}"
            + ("" if m["gap"] is None else f" ({m['gap']:.3g} nats below its argmax)")
            for m in failures
        ]
        result["message"] = (
            f"GREEDY CHECK FAILED{' (allowed by --allow-greedy-mismatch)' if allowed else ''}: "
            + "; ".join(parts)
        )
    elif result["near_ties"]:
        gaps = [m["gap"] for m in result["mismatches"]]
        result["message"] = (
            f"identical token ids {same} up to {result['near_ties']} near-ties of {ref_arm.name}'s argmax: "
            f"where an output diverges, {ref_arm.name}'s own forward put the arm's token "
            f"{min(gaps):.3g}-{max(gaps):.3g} nats below its argmax (margin {margin:g}: bf16 rounding)"
        )
    else:
        result["message"] = f"identical token ids {same}"
    return result


def _divergence_gap(top2: list | None, prompt: int, index: int, got: list[int]) -> float | None:
    """How far below the reference's argmax its own forward put the arm's token at the first
    different ``index`` (None: unknown, or not among its two best). Where the two best tie
    exactly, the top-k list may name the arm's token first though the reference's sampler chose
    the other: the gap is then 0."""
    if not top2 or prompt >= len(top2) or index >= len(top2[prompt]) or index >= len(got):
        return None
    best = max(logprob for logprob, _ in top2[prompt][index])
    mine = [logprob for logprob, token in top2[prompt][index] if token == got[index]]
    return best - mine[0] if mine else None
