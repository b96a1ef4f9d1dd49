"""Frequency, presence and repetition penalties and ``min_new_tokens``, exact per
tree path.

The plain server penalises the token after a text by what that text holds: every
output token so far (frequency counts, presence, repetition) and how many there
are (``min_new_tokens`` bans the stop tokens while the output is shorter). A tree
slot's text is the request's output before this round's root, then its own path
root ... slot, so every slot gets its own penalty: the counts the plain server
would hold had it generated that path one token at a time.

SGLang's penalizer state cannot be used for this: the spec scheduler feeds it at
most one token per round, and under overlap it lags behind by a round. The worker
keeps its own state instead, on the device, one row per request-pool slot (the
``req_pool_idx`` a request keeps for its whole decode): the output tokens before
the next root, written at prefill from the request's output so far and advanced
by the accepted path after every round, without host synchronisation.

Floating point follows the plain server's order: additive penalties
(``- frequency * count - presence``) first, then the repetition scaling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def has_penalties(params) -> bool:
    return (
        (params.frequency_penalty or 0.0) != 0.0
        or (params.presence_penalty or 0.0) != 0.0
        or (params.repetition_penalty or 1.0) != 1.0
        or (getattr(params, "min_new_tokens", 0) or 0) > 0
    )


def stop_token_ids(req) -> list[int]:
    """The tokens ``min_new_tokens`` bans: the same set as SGLang's penalizer."""
    tokenizer = getattr(req, "tokenizer", None)
    ids = set(req.sampling_params.stop_token_ids or set()) | set(req.eos_token_ids or set())
    if tokenizer is not None:
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or set())
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(tokenizer.eos_token_id)
    return sorted(i for i in ids if i is not None)


def _penalize(logits, counts, frequency, presence, repetition) -> None:
    """``logits`` ``[n, a, b]`` in place; ``counts`` broadcast to it; the
    per-request parameters are ``[n]``."""
    present = counts > 0
    additive = -(frequency[:, None, None] * counts) - presence[:, None, None] * present
    logits.add_(additive)
    scale = torch.where(present, repetition[:, None, None], 1.0)
    negative = logits < 0
    divided = logits / scale
    logits.mul_(scale)  # the plain server's where(l < 0, l * s, l / s), one temporary
    torch.where(negative, logits, divided, out=logits)


@dataclass
class RowPenalties:
    """One round's penalty inputs, one row per request of the batch."""

    counts: torch.Tensor  # [bs, vocab] float32, output tokens before the root
    out_len: torch.Tensor  # [bs] int64, output length before the root
    frequency: torch.Tensor  # [bs] float32
    presence: torch.Tensor  # [bs] float32
    repetition: torch.Tensor  # [bs] float32
    min_new: torch.Tensor  # [bs] int64
    stop_ids: torch.Tensor  # [bs, stops] int64, padded with the row's first id
    stop_valid: torch.Tensor  # [bs, stops] bool


def apply_path_penalties(
    logits: torch.Tensor,  # [bs, width, vocab], in place
    rows: RowPenalties,
    tokens: torch.Tensor,  # [bs, width]
    depths: torch.Tensor,  # [bs, width]
    path_counts: torch.Tensor,  # [bs, width, width], tree.paths.path_token_counts
) -> None:
    bs, width, _ = logits.shape
    columns = tokens[:, None, :].expand(bs, width, width)  # [b, i, j]: token of slot j
    original = logits.gather(2, columns)
    params = (rows.frequency, rows.presence, rows.repetition)
    # Tokens off the slot's path: the counts before the root, for every slot.
    _penalize(logits, rows.counts[:, None, :], *params)
    # Tokens on the slot's path: counts before the root plus their path count,
    # from the unpenalised logits. Equal tokens get equal values (see path_token_counts).
    totals = rows.counts.gather(1, tokens)[:, None, :] + path_counts
    _penalize(original, totals, *params)
    on_path = path_counts > 0
    logits.scatter_(2, columns, torch.where(on_path, original, logits.gather(2, columns)))
    _ban_stop_tokens(logits, rows, depths)


def _ban_stop_tokens(logits, rows: RowPenalties, depths) -> None:
    """A slot at depth ``d`` predicts output token ``out_len + 1 + d + 1``: the
    root and the path are output already."""
    bs, width, _ = logits.shape
    banned = (rows.out_len[:, None] + 1 + depths) < rows.min_new[:, None]  # [bs, width]
    columns = rows.stop_ids[:, None, :].expand(bs, width, -1)
    current = logits.gather(2, columns)
    blocked = banned[:, :, None] & rows.stop_valid[:, None, :]
    logits.scatter_(2, columns, torch.where(blocked, float("-inf"), current))


class PenaltyTable:
    """Per-request penalty state on the device, indexed by ``req_pool_idx``.
    Allocated when the first penalised request arrives."""

    def __init__(self, pool_rows: Callable[[], int], vocab: int, device):
        self.pool_rows, self.vocab, self.device = pool_rows, vocab, device
        self.counts: torch.Tensor | None = None

    def _allocate(self) -> None:
        rows, device = self.pool_rows(), self.device
        self.counts = torch.zeros((rows, self.vocab), dtype=torch.float32, device=device)
        self.out_len = torch.zeros(rows, dtype=torch.int64, device=device)
        self.params = torch.zeros((rows, 3), dtype=torch.float32, device=device)
        self.params[:, 2] = 1.0
        self.min_new = torch.zeros(rows, dtype=torch.int64, device=device)
        self.stop_ids = torch.zeros((rows, 1), dtype=torch.int64, device=device)
        self.stop_valid = torch.zeros((rows, 1), dtype=torch.bool, device=device)

    def register(self, reqs) -> None:
        """At prefill: each request's output so far (empty, or everything before a
        retraction) and its parameters. Rows of unpenalised requests are reset, so a
        reused pool slot never inherits a finished request's state."""
        if self.counts is None:
            if not any(has_penalties(r.sampling_params) for r in reqs):
                return
            self._allocate()
        for req in reqs:
            if getattr(req.kv, "req_pool_idx", None) is not None:
                self._register_one(req)

    def _register_one(self, req) -> None:
        row, params = int(req.kv.req_pool_idx), req.sampling_params
        self.counts[row].zero_()
        output = list(req.output_ids or [])
        if output:
            ids = torch.tensor(output, dtype=torch.int64).to(self.device)
            self.counts[row].index_add_(0, ids, torch.ones(len(output), device=self.device))
        self.out_len[row] = len(output)
        self.params[row] = torch.tensor(
            [
                params.frequency_penalty or 0.0,
                params.presence_penalty or 0.0,
                params.repetition_penalty or 1.0,
            ]
        )
        self.min_new[row] = int(getattr(params, "min_new_tokens", 0) or 0)
        stops = stop_token_ids(req) if self.min_new[row] > 0 else []
        self._write_stops(row, stops)

    def _write_stops(self, row: int, stops: list[int]) -> None:
        if len(stops) > self.stop_ids.shape[1]:
            extra = len(stops) - self.stop_ids.shape[1]
            self.stop_ids = torch.nn.functional.pad(self.stop_ids, (0, extra))
            self.stop_valid = torch.nn.functional.pad(self.stop_valid, (0, extra))
        width = self.stop_ids.shape[1]
        padded = (stops + [stops[0]] * width)[:width] if stops else [0] * width
        self.stop_ids[row] = torch.tensor(padded, dtype=torch.int64)
        self.stop_valid[row] = torch.arange(width) < len(stops)

    def rows(self, req_pool_indices: torch.Tensor) -> RowPenalties:
        idx = req_pool_indices.to(torch.int64)
        params = self.params[idx]
        return RowPenalties(
            counts=self.counts[idx],
            out_len=self.out_len[idx],
            frequency=params[:, 0],
            presence=params[:, 1],
            repetition=params[:, 2],
            min_new=self.min_new[idx],
            stop_ids=self.stop_ids[idx],
            stop_valid=self.stop_valid[idx],
        )

    def advance(self, req_pool_indices, rows: RowPenalties, tokens, path, accept_lens) -> None:
        """After the accept walk: the root and the accepted drafts are output now
        (the bonus is the next round's root)."""
        idx = req_pool_indices.to(torch.int64)
        accepted = path >= 0  # root first
        path_tokens = tokens.gather(1, path.clamp(min=0))
        counts = rows.counts.scatter_add(1, path_tokens, accepted.to(torch.float32))
        self.counts[idx] = counts
        self.out_len[idx] = rows.out_len + accept_lens.to(torch.int64) + 1
