"""The communication timers (comm/timers.py) driven by a fake clock, then on real gloo collectives (a world
of one); the split of exposed time into skew and transfer (comm/skew.py) with a fake group's arrival stamps. The
distributed physics checks (exposed time against wall clock, bytes and link rate, a late rank's skew) are in
tests/distributed/test_comm_timers_physics.py."""

import pytest
import torch

from megatron_moe import comm
from megatron_moe.comm import Collective
from megatron_moe.comm.timers import SUMMARY_KINDS, CommTimers, WireLine
from megatron_moe.platform.timing import HostStamps


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def advance(self, ms: float):
        self.now += ms / 1000.0


class FakeFuture:
    def __init__(self):
        self.callbacks = []

    def add_done_callback(self, callback):
        self.callbacks.append(callback)

    def finish(self):
        for callback in self.callbacks:
            callback(self)


class FakeWork:
    def __init__(self):
        self.future = FakeFuture()

    def get_future(self):
        return self.future


def sync(timers, clock, collective, ms):
    """What `issue` does for a synchronous collective that takes `ms`."""
    token = timers.issued(collective)
    timers.blocked(token)
    clock.advance(ms)
    timers.unblocked(token, completed=True)


def start_async(timers, clock, collective, start_ms=0.0):
    token = timers.issued(collective)
    timers.blocked(token)
    clock.advance(start_ms)
    work = FakeWork()
    timers.handle(token, work)
    timers.unblocked(token, completed=False)
    return token, work


def wait(timers, clock, token, ms):
    timers.blocked(token)
    clock.advance(ms)
    timers.unblocked(token, completed=True)


GROUP = object()
"""A stand-in process group of global ranks (0, 1), this process rank 0 (`two_rank_timers`)."""
KEY = ((0, 1), "ep")


def two_rank_timers(clock, **kwargs) -> CommTimers:
    """Timers whose arrival stamps are on `clock` (wall = clock) and whose `GROUP` is ranks (0, 1), this one 0."""
    timers = CommTimers(stamps=HostStamps(clock, wall=clock), **kwargs)
    timers.arrivals._key = lambda group: KEY if group is GROUP else ((0,), "")
    timers.arrivals.rank = 0
    return timers


def summary_with_peer(timers: CommTimers, peer: list[float]):
    """The summary with rank 1's arrivals (seconds on the fake clock) at `GROUP`'s collectives, in order, as the
    exchange would have gathered them (rank 0's: its own stamps)."""

    def exchange(reader):
        assert reader == 1
        seen = timers.arrivals._seen
        mine = timers.stamps.host_seconds([stamp for key, stamp in seen if key == KEY])
        return {KEY: [mine, peer]}

    timers.arrivals.exchange = exchange
    return timers.summary(reader=1)


def test_synchronous_collective_is_all_exposed():
    clock = Clock()
    timers = CommTimers(clock=clock)
    sync(timers, clock, Collective("dp_grad_reduce", "grads", nbytes=800), 7.0)
    clock.advance(3.0)  # compute, not communication
    sync(timers, clock, Collective("dp_grad_reduce", "grads", nbytes=200), 5.0)
    s = timers.summary()
    assert s.comm_ms["dp_grad_reduce"] == pytest.approx(12.0)
    assert s.exposed_ms["dp_grad_reduce"] == pytest.approx(12.0)
    assert s.bytes["dp_grad_reduce"] == 1000 and s.calls["dp_grad_reduce"] == 2
    # No fitted line: the wire time is the bytes at the window's fastest rate (7 ms / 800 B), the rest waiting.
    assert s.wire_ms["dp_grad_reduce"] == pytest.approx(1000 * 7.0 / 800) and s.wire_from["dp_grad_reduce"] == "timers"
    # Not a kind whose skew is measured: all of its exposed time is transfer.
    assert s.skew_ms["dp_grad_reduce"] == 0.0 and s.transfer_ms["dp_grad_reduce"] == pytest.approx(12.0)
    assert s.skew_from["dp_grad_reduce"] == ""
    assert s.hidden_frac == pytest.approx(0.0)
    assert set(s.comm_ms) == set(SUMMARY_KINDS) and s.comm_ms["tp"] == 0.0
    assert s.per_layer == {}


def test_asynchronous_collective_finished_under_compute_is_hidden():
    """Issued, 1 ms to start, completes (future) after 6 ms while 10 ms of compute run, waited: 0.5 ms. The only
    collective of its family: its span is the link's rate, 6 ms on the wire."""
    clock = Clock()
    timers = CommTimers(clock=clock)
    token, work = start_async(timers, clock, Collective("a2a_dispatch", "dispatch", layer=2, nbytes=64), 1.0)
    clock.advance(5.0)
    work.future.finish()  # the transfer completes (gloo's thread)
    clock.advance(5.0)
    wait(timers, clock, token, 0.5)
    s = timers.summary()
    assert s.comm_ms["a2a_dispatch"] == pytest.approx(6.0)
    assert s.exposed_ms["a2a_dispatch"] == pytest.approx(1.5)
    assert s.wire_ms["a2a_dispatch"] == pytest.approx(6.0)
    assert s.hidden_frac == pytest.approx(1 - 1.5 / 6.0)
    assert s.per_layer[2]["comm_ms"] == {"a2a_dispatch": pytest.approx(6.0)}
    assert s.per_layer[2]["bytes"] == {"a2a_dispatch": 64}


def test_asynchronous_collective_longer_than_compute_exposes_the_rest():
    """No future callback before the wait: completion is where the wait ended; exposed = comm - compute."""
    clock = Clock()
    timers = CommTimers(clock=clock)
    token, work = start_async(timers, clock, Collective("a2a_combine", "combine", layer=0, nbytes=100))
    clock.advance(4.0)  # compute
    wait(timers, clock, token, 6.0)
    work.future.finish()  # the callback that comes after the wait does not move the completion
    s = timers.summary()
    assert s.comm_ms["a2a_combine"] == pytest.approx(10.0)
    assert s.exposed_ms["a2a_combine"] == pytest.approx(6.0)
    assert s.wire_ms["a2a_combine"] == pytest.approx(10.0)  # the only one: its span at its own rate
    assert s.hidden_frac == pytest.approx(0.4)


def test_backward_all_to_alls_and_layers_are_apart():
    clock = Clock()
    timers = CommTimers(clock=clock)
    sync(timers, clock, Collective("a2a_dispatch", "dispatch", layer=1, nbytes=10), 1.0)
    sync(timers, clock, Collective("a2a_combine", "combine", layer=1, nbytes=20), 2.0)
    sync(timers, clock, Collective("a2a_dispatch", "dispatch", layer=3, nbytes=30), 3.0)
    sync(timers, clock, Collective("a2a_combine", "combine", layer=3, backward=True, nbytes=40), 4.0)
    sync(timers, clock, Collective("a2a_dispatch", "dispatch", layer=1, backward=True, nbytes=50), 5.0)
    sync(timers, clock, Collective("other", "loss"), 6.0)
    s = timers.summary()
    assert s.comm_ms == {
        "a2a_dispatch": pytest.approx(4.0),
        "a2a_dispatch_bwd": pytest.approx(5.0),
        "a2a_combine": pytest.approx(2.0),
        "a2a_combine_bwd": pytest.approx(4.0),
        "esp_ag": 0.0,
        "esp_ag_bwd": 0.0,
        "esp_rs": 0.0,
        "esp_rs_bwd": 0.0,
        "shadow": 0.0,
        "shadow_bwd": 0.0,
        "dp_grad_reduce": 0.0,
        "tp": 0.0,
        "pp_p2p": 0.0,
        "other": pytest.approx(6.0),
    }
    assert s.bytes["a2a_dispatch"] == 40 and s.bytes["a2a_combine_bwd"] == 40
    layer1 = {"a2a_dispatch": 1.0, "a2a_combine": 2.0, "a2a_dispatch_bwd": 5.0}
    assert s.per_layer[1]["exposed_ms"] == pytest.approx(layer1)
    assert s.per_layer[3]["bytes"] == {"a2a_dispatch": 30, "a2a_combine_bwd": 40}
    assert s.per_layer[1]["calls"] == {"a2a_dispatch": 1, "a2a_combine": 1, "a2a_dispatch_bwd": 1}
    assert s.calls == {
        **dict.fromkeys(SUMMARY_KINDS, 0),
        "a2a_dispatch": 2,
        "a2a_dispatch_bwd": 1,
        "a2a_combine": 1,
        "a2a_combine_bwd": 1,
        "other": 1,
    }
    assert set(s.per_layer) == {1, 3}
    d = s.as_dict()
    assert d["per_layer"][3]["comm_ms"]["a2a_combine_bwd"] == pytest.approx(4.0) and d["hidden_frac"] == 0.0


def test_esp_all_gather_and_reduce_scatter_have_their_backward_apart():
    clock = Clock()
    timers = CommTimers(clock=clock)
    sync(timers, clock, Collective("esp_ag", "esp_all_gather", layer=2, nbytes=8), 1.0)
    sync(timers, clock, Collective("esp_rs", "esp_reduce_scatter", layer=2, backward=True, nbytes=16), 3.0)
    sync(timers, clock, Collective("esp_ag", "esp_all_gather", layer=2, backward=True, nbytes=32), 2.0)
    s = timers.summary()
    assert {k: v for k, v in s.comm_ms.items() if k.startswith("esp_")} == {
        "esp_ag": pytest.approx(1.0),
        "esp_ag_bwd": pytest.approx(2.0),
        "esp_rs": 0.0,
        "esp_rs_bwd": pytest.approx(3.0),
    }
    assert s.per_layer[2]["bytes"] == {"esp_ag": 8, "esp_rs_bwd": 16, "esp_ag_bwd": 32}


def test_reset_starts_a_new_window():
    clock = Clock()
    timers = CommTimers(clock=clock)
    sync(timers, clock, Collective("tp", "gather", nbytes=8), 2.0)
    timers.reset()
    s = timers.summary()
    assert s.total_comm_ms == 0.0 and s.bytes["tp"] == 0 and s.hidden_frac == 0.0
    sync(timers, clock, Collective("tp", "gather", nbytes=8), 3.0)
    assert timers.summary().comm_ms["tp"] == pytest.approx(3.0)


def test_a_collective_still_in_flight_counts_its_blocked_time_only():
    clock = Clock()
    timers = CommTimers(clock=clock)
    start_async(timers, clock, Collective("pp_p2p", "send"), 2.0)
    s = timers.summary()
    assert s.comm_ms["pp_p2p"] == pytest.approx(2.0) and s.exposed_ms["pp_p2p"] == pytest.approx(2.0)


def test_real_collectives_through_issue(megatron_world1):
    """gloo's work futures stamp completion; a second monitor (a Recorder-like one) sees the same calls."""
    import torch.distributed as dist

    x = torch.ones(1 << 16)
    with comm.monitoring(CommTimers()) as timers:
        comm.issue(Collective("other", "sync", nbytes=4 << 16), lambda: dist.all_reduce(x))
        work = comm.issue(
            Collective("a2a_dispatch", "async", layer=0, nbytes=4 << 16), lambda: dist.all_reduce(x, async_op=True)
        )
        work.wait()
    s = timers.summary()
    assert s.bytes == {**dict.fromkeys(SUMMARY_KINDS, 0), "other": 4 << 16, "a2a_dispatch": 4 << 16}
    assert s.comm_ms["other"] > 0 and s.comm_ms["a2a_dispatch"] > 0
    # Synchronous: blocked after issued, completed where unblocked (no timing tolerance: the machine is shared).
    assert 0 < s.exposed_ms["other"] <= s.comm_ms["other"]
    assert s.exposed_ms["a2a_dispatch"] > 0
    assert s.calls == {**dict.fromkeys(SUMMARY_KINDS, 0), "other": 1, "a2a_dispatch": 1}
    assert s.per_layer[0]["bytes"] == {"a2a_dispatch": 4 << 16}


def test_a_peer_that_waited_counts_as_exposed_not_hidden():
    """The issue's complaint: an all-to-all issued before 90 ms of compute whose peer came late, waited for 12 ms;
    its bytes need 10 ms on the link (the fitted line). Issued -> done is 102 ms, so `1 - exposed / comm` said 88%
    hidden; against the link's 10 ms nothing was hidden. The peer's arrival stamp says it issued 95 ms after this
    rank: 5 ms of the wait were skew, 7 ms transfer (exposed - wire would have said 2 ms of waiting)."""
    clock = Clock()
    timers = two_rank_timers(clock, wire_lines={"a2a_dispatch": WireLine(alpha_ms=1.0, ms_per_byte=0.009)})
    dispatch = Collective("a2a_dispatch", "dispatch", GROUP, layer=1, nbytes=2000, wire_bytes=1000)
    token, _ = start_async(timers, clock, dispatch)
    clock.advance(90.0)  # compute; the peer has not sent yet
    wait(timers, clock, token, 12.0)
    s = summary_with_peer(timers, [100.095])
    assert s.comm_ms["a2a_dispatch"] == pytest.approx(102.0) and s.exposed_ms["a2a_dispatch"] == pytest.approx(12.0)
    assert s.wire_ms["a2a_dispatch"] == pytest.approx(1.0 + 9.0) and s.wire_from["a2a_dispatch"] == "fit"
    assert s.skew_ms["a2a_dispatch"] == pytest.approx(5.0) and s.transfer_ms["a2a_dispatch"] == pytest.approx(7.0)
    assert s.skew_from["a2a_dispatch"] == "arrivals"
    assert s.hidden_frac == 0.0
    assert s.per_layer[1]["wire_ms"] == {"a2a_dispatch": pytest.approx(10.0)}
    assert s.per_layer[1]["skew_ms"] == {"a2a_dispatch": pytest.approx(5.0)}
    assert s.per_layer[1]["transfer_ms"] == {"a2a_dispatch": pytest.approx(7.0)}


def test_only_the_bytes_that_cross_count_on_the_wire():
    """`bytes`: the send buffer; `wire_bytes`: what left the rank (an all-to-all's own block stays). The fitted
    line prices the crossing bytes only."""
    clock = Clock()
    timers = CommTimers(clock=clock, wire_lines={"a2a_combine": WireLine(alpha_ms=0.0, ms_per_byte=0.01)})
    sync(timers, clock, Collective("a2a_combine", "combine", layer=0, nbytes=1000, wire_bytes=500), 6.0)
    sync(timers, clock, Collective("other", "loss", nbytes=8), 1.0)  # wire_bytes None: all of it leaves
    s = timers.summary()
    assert s.bytes["a2a_combine"] == 1000 and s.wire_bytes["a2a_combine"] == 500
    assert s.wire_bytes["other"] == s.bytes["other"] == 8
    assert s.wire_ms["a2a_combine"] == pytest.approx(5.0)  # not 10: half the buffer never leaves
    assert s.wire_from == {**dict.fromkeys(SUMMARY_KINDS, ""), "a2a_combine": "fit", "other": "timers"}


def test_without_a_fitted_line_the_fastest_rate_of_the_family_prices_the_bytes():
    """The four MoE all-to-all kinds share one rate: the fastest complete collective's ms per crossing byte
    (a dispatch of 1,000 B in 4 ms); a collective still in flight does not set it, a zero-byte one costs nothing."""
    clock = Clock()
    timers = CommTimers(clock=clock)
    sync(timers, clock, Collective("a2a_dispatch", "dispatch", layer=0, nbytes=2000, wire_bytes=1000), 4.0)
    sync(timers, clock, Collective("a2a_combine", "combine", layer=0, backward=True, wire_bytes=1000), 9.0)
    sync(timers, clock, Collective("a2a_combine", "counts", layer=0, wire_bytes=0), 3.0)
    start_async(timers, clock, Collective("a2a_dispatch", "dispatch", layer=0, backward=True, wire_bytes=1000))
    s = timers.summary()
    assert s.wire_ms["a2a_dispatch"] == pytest.approx(4.0)
    assert s.wire_ms["a2a_combine_bwd"] == pytest.approx(4.0)
    assert s.wire_ms["a2a_combine"] == 0.0
    assert s.wire_ms["a2a_dispatch_bwd"] == pytest.approx(4.0)  # priced, though its own span is not a rate
    assert s.hidden_frac == pytest.approx(0.0)  # everything synchronous: exposed (16 ms) > wire (12 ms)


def test_a_hidden_transfer_is_hidden_against_its_wire_time():
    """Issued, the transfer completes under compute, the wait finds it done: fully hidden, whatever the span."""
    clock = Clock()
    timers = CommTimers(clock=clock, wire_lines={"a2a_dispatch_bwd": WireLine(alpha_ms=0.5, ms_per_byte=0.001)})
    collective = Collective("a2a_dispatch", "dispatch", layer=0, backward=True, nbytes=8000, wire_bytes=4000)
    token, work = start_async(timers, clock, collective)
    clock.advance(20.0)
    work.future.finish()
    clock.advance(5.0)
    wait(timers, clock, token, 0.0)
    s = timers.summary()
    assert s.wire_ms["a2a_dispatch_bwd"] == pytest.approx(4.5) and s.hidden_frac == pytest.approx(1.0)


def test_an_all_to_all_records_the_block_it_keeps_as_not_crossing(megatron_world1):
    """comm/moe.py's all-to-alls: `bytes` the whole send buffer, `wire_bytes` without this rank's own block (in a
    world of one, all of it), forward and backward."""
    from megatron_moe.comm.moe import dispatch_all_to_all

    rows_RH = torch.ones(6, 4, requires_grad=True)
    with comm.monitoring(CommTimers()) as timers:
        out_RH = dispatch_all_to_all(rows_RH, [6], [6], None, layer=0).wait()
        out_RH.sum().backward()
    s = timers.summary()
    assert s.bytes["a2a_dispatch"] == s.bytes["a2a_dispatch_bwd"] == 6 * 4 * 4
    assert s.wire_bytes["a2a_dispatch"] == s.wire_bytes["a2a_dispatch_bwd"] == 0
    assert s.wire_ms["a2a_dispatch"] == 0.0 and s.hidden_frac == 0.0


def test_ring_collectives_send_their_foreign_blocks():
    assert comm.core.ring_wire_bytes(1000, 4) == 750  # all-gather / reduce-scatter: 3 of 4 blocks
    assert comm.core.ring_wire_bytes(1000, 4, all_reduce=True) == 1500
    assert comm.core.ring_wire_bytes(1000, 1) == 0


def test_a_late_peer_is_skew_and_the_rest_transfer_per_kind_and_layer():
    """Rank 0 of two: a synchronous dispatch whose peer came 8 ms late (blocked 11 ms: 8 skew, 3 transfer), a
    combine where rank 0 came last (blocked 4 ms: all transfer), its backward whose peer came 20 ms late but was
    waited for after 25 ms of compute (blocked 2 ms: transfer). The planning twin (another group of the same ranks)
    counts its own collectives: the k-th arrival of each group is matched."""
    clock = Clock()
    timers = two_rank_timers(clock)
    twin, twin_key = object(), ((0, 1), "ep-planning")
    keys = {GROUP: KEY, twin: twin_key}
    timers.arrivals._key = lambda group: keys[group]
    sync(timers, clock, Collective("a2a_dispatch", "exchange_counts", twin, layer=2), 1.0)  # at 100.000
    sync(timers, clock, Collective("a2a_dispatch", "dispatch", GROUP, layer=2), 11.0)  # at 100.001
    sync(timers, clock, Collective("a2a_combine", "combine", GROUP, layer=2), 4.0)  # at 100.012
    token, _ = start_async(timers, clock, Collective("a2a_combine", "combine", GROUP, layer=2, backward=True))
    clock.advance(25.0)  # compute; issued at 100.016, the peer at 100.036
    wait(timers, clock, token, 2.0)
    sync(timers, clock, Collective("dp_grad_reduce", "grads"), 3.0)

    def exchange(reader):
        seen = timers.arrivals._seen
        mine = {key: [stamp for k, stamp in seen if k == key] for key in (KEY, twin_key)}
        return {KEY: [mine[KEY], [100.009, 100.010, 100.036]], twin_key: [mine[twin_key], [100.0005]]}

    timers.arrivals.exchange = exchange
    s = timers.summary(reader=1)
    assert s.exposed_ms["a2a_dispatch"] == pytest.approx(12.0)
    assert s.skew_ms["a2a_dispatch"] == pytest.approx(0.5 + 8.0)
    assert s.transfer_ms["a2a_dispatch"] == pytest.approx(0.5 + 3.0)
    assert s.skew_ms["a2a_combine"] == 0.0 and s.transfer_ms["a2a_combine"] == pytest.approx(4.0)
    assert s.skew_ms["a2a_combine_bwd"] == 0.0 and s.transfer_ms["a2a_combine_bwd"] == pytest.approx(2.0)
    assert s.per_layer[2]["skew_ms"] == {
        "a2a_dispatch": pytest.approx(8.5),
        "a2a_combine": 0.0,
        "a2a_combine_bwd": 0.0,
    }
    assert s.skew_from == {
        **dict.fromkeys(SUMMARY_KINDS, ""),
        **dict.fromkeys(("a2a_dispatch", "a2a_combine", "a2a_combine_bwd"), "arrivals"),
    }
    assert s.skew_ms["dp_grad_reduce"] == 0.0 and s.transfer_ms["dp_grad_reduce"] == pytest.approx(3.0)
    for kind in SUMMARY_KINDS:  # exposed = skew + transfer, kind by kind
        assert s.skew_ms[kind] + s.transfer_ms[kind] == pytest.approx(s.exposed_ms[kind])
    assert s.total_skew_ms == pytest.approx(8.5)
    assert s.total_transfer_ms == pytest.approx(s.total_exposed_ms - 8.5)


def test_without_the_exchange_nothing_is_called_skew():
    """`summary()` with no reader (the benchmarks' own timers): the MoE kinds are not split."""
    clock = Clock()
    timers = two_rank_timers(clock)
    sync(timers, clock, Collective("a2a_dispatch", "dispatch", GROUP, layer=0), 6.0)
    s = timers.summary()
    assert s.skew_ms["a2a_dispatch"] == 0.0 and s.transfer_ms["a2a_dispatch"] == pytest.approx(6.0)
    assert s.skew_from["a2a_dispatch"] == ""


def test_real_collectives_on_a_group_of_one_have_no_skew(megatron_world1):
    """A world of one: the exchange gathers nothing (no peer), and every exposed ms is transfer."""
    rows_RH = torch.ones(6, 4, requires_grad=True)
    from megatron_moe.comm.moe import dispatch_all_to_all

    with comm.monitoring(CommTimers()) as timers:
        dispatch_all_to_all(rows_RH, [6], [6], None, layer=0).wait().sum().backward()
    s = timers.summary(reader=0)
    assert s.skew_from["a2a_dispatch"] == s.skew_from["a2a_dispatch_bwd"] == "arrivals"
    assert s.skew_ms["a2a_dispatch"] == 0.0 and s.transfer_ms["a2a_dispatch"] == s.exposed_ms["a2a_dispatch"]
    assert s.calls["other"] == 0  # no exchange collective was issued
