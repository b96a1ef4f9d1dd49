"""A cheap fingerprint of one round's trees and accepted paths, computed on their device.

Tensor-parallel ranks must build the same tree and walk the same path every round
(``tree/topk.py``); comparing a few int64 numbers across ranks is far cheaper than
comparing the tensors. Each part is hashed on its own, so a difference names the part.

The hash is ``sum_i w_i * (x_i mod P) mod P`` with ``P = 2^31 - 1`` and a distinct weight
``w_i`` in ``[1, P)`` per element: every product fits in int64, the sum of up to 2^32 of
them too, and changing any single element (by less than ``P``, as any token id, slot or
length does) always changes the hash.
"""

from __future__ import annotations

import torch

from .types import Acceptance, Trees

MODULUS = 2_147_483_647  # 2^31 - 1, prime
# Position weights from a multiplicative congruential sequence mod P (distinct, never 0).
_WEIGHT_MULTIPLIER = 48_271

PARTS = ("tree tokens", "tree parents", "tree sizes", "accepted path", "accept lengths", "bonus tokens")


def position_weights(n: int, device) -> torch.Tensor:
    """``[n]`` int64 weights in ``[1, P)``, distinct for ``n < P``."""
    index = torch.arange(n, device=device, dtype=torch.int64)
    return (index * _WEIGHT_MULTIPLIER) % (MODULUS - 1) + 1


def tensor_hash(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 hash of ``tensor``'s integer values in order, on its device."""
    flat = tensor.reshape(-1).to(torch.int64)
    residues = torch.remainder(flat, MODULUS)
    weighted = residues * position_weights(flat.numel(), flat.device) % MODULUS
    return (weighted.sum() + flat.numel()) % MODULUS


def round_fingerprint(trees: Trees, acceptance: Acceptance) -> torch.Tensor:
    """``[len(PARTS)]`` int64: one hash per part of the round, in :data:`PARTS` order."""
    parts = (
        trees.tokens,
        trees.parents,
        trees.tree_sizes,
        acceptance.path,
        acceptance.accept_lens,
        acceptance.bonus,
    )
    return torch.stack([tensor_hash(part) for part in parts])
