"""The load report's words follow the sign of its numbers (bench/compare.py)."""

import pytest

from specbuild.bench.compare import change_phrase, compare, ratio_phrase


def test_direction_follows_the_sign():
    assert change_phrase(1.457, 1.117) == "30% higher"  # the latency, once printed "-30% lower"
    assert change_phrase(1.117, 1.457) == "23% lower"
    assert change_phrase(100.0, 100.2) == "the same"
    assert change_phrase(100.0, 100.6) == "1% lower"
    assert change_phrase(1.0, 3.0, digits=1) == "66.7% lower"


def test_compare_names_both_numbers_and_the_verdict():
    assert compare("mean e2e latency", 1.457, 1.117, "s") == "mean e2e latency 1.457 s vs 1.117 s: 30% higher (worse)"
    assert compare("mean e2e latency", 0.8, 1.0, "s") == "mean e2e latency 0.8 s vs 1 s: 20% lower (better)"
    assert compare("throughput", 130.0, 100.0, "tok/s", better="higher") == \
        "throughput 130 tok/s vs 100 tok/s: 30% higher (better)"
    assert compare("TTFT p50", 387.0, 387.0, "ms") == "TTFT p50 387 ms vs 387 ms: the same"
    assert ratio_phrase(119.0, 160.6) == "0.74x"


def test_bad_input_is_refused_with_the_values():
    with pytest.raises(ValueError, match="baseline 0"):
        change_phrase(1.0, 0)
    with pytest.raises(ValueError, match="nan"):
        ratio_phrase(float("nan"), 1.0)
    with pytest.raises(ValueError, match="better='faster'"):
        compare("x", 1.0, 2.0, better="faster")
