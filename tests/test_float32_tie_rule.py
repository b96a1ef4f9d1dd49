"""The GPU suite's float32 tie rule (tests/gpu_server/arms.py): a difference from plain passes
only at a tie the plain server's own forward cannot break, never at a real preference."""

from gpu_server.arms import FP32_TIE, is_float32_tie

# The case seen on the H200 at 27ce76a: plain's decode emitted 302, its own prefill ranks 2709
# first by 5.2e-5 nats, the tree emitted 2709.
SEEN = [(-3.0429205894470215, 2709), (-3.0429725646972656, 302)]


def test_the_seen_tie_is_a_tie_either_way_round():
    assert is_float32_tie(SEEN, expected=302, got=2709)
    assert is_float32_tie(SEEN, expected=2709, got=302)


def test_a_gap_beyond_the_tie_is_a_defect():
    top2 = [(-3.0, 2709), (-3.0 - 2 * FP32_TIE, 302)]
    assert not is_float32_tie(top2, expected=302, got=2709)


def test_a_token_outside_the_top_two_is_a_defect():
    assert not is_float32_tie(SEEN, expected=302, got=11)
    assert not is_float32_tie(SEEN, expected=11, got=2709)
