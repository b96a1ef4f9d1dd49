"""Output lengths around a mean, seeded (the modelled server of :mod:`.online_budget_sim`).

With one output length for every request (and ``ignore_eos``), the requests of a closed-loop
level stay in lockstep under plain decoding: they start together, finish on the same step,
and the next wave is prefilled in one batch, once per ``output_len`` steps. Speculative
requests accept different numbers of tokens per round, drift apart, and each finished one is
prefilled on its own between rounds: every prefill of a large target reads its weights like a
decode step. A service never sees that lockstep, so each request's length is drawn (seeded, the
same for every arm) from ``[(1 - spread) L, (1 + spread) L]``: plain requests drift apart too,
and the mean is ``L``. (The A/B tool draws its own from ``[R L, L]``: ``--range-ratio R``.)
"""

from __future__ import annotations

import random


def output_lens(n: int, output_len: int, spread: float, seed: int) -> list[int]:
    """``n`` lengths around ``output_len``, uniform over ``[(1 - spread), (1 + spread)] x
    output_len`` (at least 1), the same for the same arguments."""
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"output length spread must be in [0, 1), got {spread}")
    rng = random.Random(seed)
    low, high = output_len * (1.0 - spread), output_len * (1.0 + spread)
    return [max(1, round(rng.uniform(low, high))) for _ in range(n)]
