"""tools/bench_link.py: the achieved rate is the slope of the median call time over the bytes that cross a link."""

import pytest

from tests.conftest import load_tool

link_tool = load_tool("bench_link")


def test_the_rate_is_the_slope_of_the_median_times():
    sizes = [8 << 20, 16 << 20]
    seconds = {str(sizes[0]): [0.134, 0.135, 0.210], str(sizes[1]): [0.268, 0.267, 0.269]}  # 0.210: a busy core
    result = {"world": 2, "ranks": [0, 1], "seconds": seconds}
    row = link_tool.summarize(0.5, sizes, result)
    assert row["ms"] == [135.0, 268.0] and row["crossing_bytes"] == [4 << 20, 8 << 20]
    assert row["bytes_per_s"] == pytest.approx((4 << 20) / 0.133, abs=1)
    assert row["fixed_ms"] == 2.0 and row["fraction_of_tc"] == round((4 << 20) / 0.133 * 8 / 0.5e9, 3)
