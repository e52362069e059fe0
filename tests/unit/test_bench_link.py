"""tools/bench_link.py counts gloo's usual (half-rate) mode, whichever mode a majority of a few calls landed in."""

from tests.conftest import load_tool

link_tool = load_tool("bench_link")


def test_the_half_rate_mode_is_counted_even_when_most_calls_ran_at_the_full_rate():
    # The calls of the CI run that once failed the median: 3 of 5 at the full rate.
    usual, full_rate = link_tool.usual_mode([0.069, 0.135, 0.070, 0.134, 0.068])
    assert usual == 0.1345 and full_rate == 3
    # A lone slow call (a busy core) is not a mode; the common time stands.
    usual, full_rate = link_tool.usual_mode([0.134, 0.135, 0.210, 0.136, 0.071])
    assert usual == 0.135 and full_rate == 1


def test_the_rate_is_the_slope_of_the_usual_times():
    sizes = [8 << 20, 16 << 20]
    seconds = {str(sizes[0]): [0.134] * 3, str(sizes[1]): [0.268, 0.134, 0.268]}
    result = {"world": 2, "ranks": [0, 1], "seconds": seconds}
    row = link_tool.summarize(0.5, sizes, result)
    assert row["ms"] == [134.0, 268.0] and row["full_rate_calls"] == [0, 1]
    assert row["fixed_ms"] == 0.0 and row["bytes_per_s"] == round((4 << 20) / 0.134)
