"""lab.bench.memory_check: SGLang's speculative memory check's sum against the reservation's."""

from lab.bench.memory_check import measure


def test_both_sums_are_timed_on_the_same_requests():
    rows = measure([1, 3], [1, 16], number=5)
    assert [(r["page"], r["bs"]) for r in rows] == [(1, 1), (1, 3), (16, 1), (16, 3)]
    assert all(r["sglang_us"] > 0 and r["slots_short_us"] > 0 for r in rows)
