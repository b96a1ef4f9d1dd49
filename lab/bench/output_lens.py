"""Output lengths for the served A/B benchmarks (``k26_ab``, ``gpu_rounds``).

With one output length for every request (and ``ignore_eos``), the requests of a closed-loop
level stay in lockstep under plain decoding: they start together, finish on the same step,
and the next wave is prefilled in one batch, once per ``output_len`` steps. Speculative
requests accept different numbers of tokens per round, drift apart, and each finished one is
prefilled on its own between rounds: every prefill of a large target reads its weights like a
decode step. On the K2.6 rank at b583d8b (64-token outputs) the speculative arms lost 12-40 ms
of decoding per prefilled request against ~1 ms for plain. A service never sees that lockstep,
so each request's length is drawn (seeded, the same for every arm) from
``[(1 - spread) L, (1 + spread) L]``: plain requests drift apart too, and the mean is ``L``.
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


def longest(output_len: int, spread: float) -> int:
    """The longest length :func:`output_lens` can draw (what a recording must cover)."""
    return max(1, round(output_len * (1.0 + spread)))


def add_arguments(parser, default_len: int) -> None:
    """``--output-len`` and ``--output-len-spread`` (the A/B benchmarks share them)."""
    parser.add_argument("--output-len", type=int, default=default_len, help="mean output tokens per request")
    parser.add_argument(
        "--output-len-spread",
        type=float,
        default=0.5,
        help="each request's output length is drawn from [(1-s), (1+s)] x --output-len (seeded, the "
        "same in every arm; 0: one length, which keeps plain requests in lockstep: bench/output_lens.py)",
    )
