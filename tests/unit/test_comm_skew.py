"""comm/skew.py: the split of a collective's exposed time at its group's last arrival, the arrival stamps, their
conversion to the wall clock and the clock offset of one process. With the timers: tests/unit/test_comm_timers.py;
a late rank on the emulated cluster: tests/distributed/test_comm_timers_physics.py."""

import pytest

from megatron_moe.comm import Collective
from megatron_moe.comm.skew import (
    SKEW_KINDS,
    Arrivals,
    ClockOffset,
    estimate_clock_offset,
    last_arrival_wait_ms,
    split_exposed,
)
from megatron_moe.platform.timing import HostStamps
from tests.unit.test_comm_timers import Clock


def test_split_exposed_cuts_the_blocked_spans_at_the_last_arrival():
    """Spans in ms since this rank issued; the last rank arrived `wait_ms` after it."""
    assert split_exposed([(0.0, 12.0)], 5.0) == (pytest.approx(5.0), pytest.approx(7.0))  # synchronous
    assert split_exposed([(0.0, 12.0)], 0.0) == (0.0, pytest.approx(12.0))  # this rank came last
    assert split_exposed([(0.0, 12.0)], 30.0) == (pytest.approx(12.0), 0.0)  # still waiting when unblocked
    # Asynchronous: 1 ms to start, compute, then a wait from 90 ms to 102 ms; the peer came at 95 ms. The compute
    # while the peer was late is neither.
    assert split_exposed([(0.0, 1.0), (90.0, 102.0)], 95.0) == (pytest.approx(6.0), pytest.approx(7.0))
    assert split_exposed([(0.0, 1.0), (90.0, 102.0)], 50.0) == (pytest.approx(1.0), pytest.approx(12.0))
    assert split_exposed([], 40.0) == (0.0, 0.0)
    assert split_exposed([(0.0, 3.0)], -2.0) == (0.0, pytest.approx(3.0))  # clock error: last before this rank


def test_arrivals_stamp_only_the_kinds_whose_skew_is_measured_and_reset():
    clock = Clock()
    arrivals = Arrivals(HostStamps(clock, wall=clock))
    assert set(SKEW_KINDS) == {"a2a_dispatch", "a2a_combine", "esp_ag", "esp_rs", "shadow"}
    arrivals.issued(Collective("dp_grad_reduce", "grads"))
    arrivals.issued(Collective("a2a_dispatch", "dispatch", layer=0))
    clock.advance(3.0)
    arrivals.issued(Collective("esp_ag", "esp_all_gather", layer=0, backward=True))
    assert [stamp for _, stamp in arrivals._seen] == [100.0, pytest.approx(100.003)]
    assert arrivals.exchange(reader=0) == {}  # a group of one rank: nothing to gather
    arrivals.reset()
    assert arrivals._seen == [] and arrivals._counts == {}


def test_host_stamps_convert_to_the_wall_clock():
    stamps = HostStamps(clock=lambda: 5.0, wall=lambda: 1005.5)
    assert stamps.host_seconds([4.0, 5.0]) == [pytest.approx(1004.5), pytest.approx(1005.5)]


def test_one_process_has_no_clock_offset():
    assert estimate_clock_offset() == ClockOffset(0.0, 0.0, shared=True)


def test_the_wait_is_to_the_last_arrival_of_the_group():
    """Rank 2 of group (0, 2, 5) arrived at its second collective at 10.004; rank 5 came last, at 10.010."""
    key = ((0, 2, 5), "ep")
    table = [[9.0, 10.001], [9.5, 10.004], [9.2, 10.010]]
    assert last_arrival_wait_ms({key: table}, (key, 1), 2) == pytest.approx(6.0)
    assert last_arrival_wait_ms({key: table}, (key, 1), 5) == 0.0  # the last waits for no one
    assert last_arrival_wait_ms({key: table}, (key, 0), 0) == pytest.approx(500.0)
    assert last_arrival_wait_ms({}, (key, 0), 0) is None  # not exchanged: not known
    assert last_arrival_wait_ms({}, (((3,), "ep"), 0), 3) == 0.0  # a group of one rank
    assert last_arrival_wait_ms({key: table}, None, 0) is None  # a kind whose skew is not measured
