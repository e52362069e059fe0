"""The communication timers (comm/timers.py) driven by a fake clock, then on real gloo collectives (a world
of one). The distributed physics checks (exposed time against wall clock, bytes and link rate) are in
tests/distributed/test_comm_timers_physics.py."""

import pytest
import torch

from megatron_moe import comm
from megatron_moe.comm import Collective
from megatron_moe.comm.timers import SUMMARY_KINDS, CommTimers


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
    assert s.hidden_frac == pytest.approx(0.0)
    assert set(s.comm_ms) == set(SUMMARY_KINDS) and s.comm_ms["tp"] == 0.0
    assert s.per_layer == {}


def test_asynchronous_collective_finished_under_compute_is_hidden():
    """Issued, 1 ms to start, completes (future) after 6 ms while 10 ms of compute run, waited: 0.5 ms."""
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
    assert s.hidden_frac == pytest.approx(1 - 1.5 / 6.0)
    assert s.per_layer[2]["comm_ms"] == {"a2a_dispatch": pytest.approx(6.0)}
    assert s.per_layer[2]["bytes"] == {"a2a_dispatch": 64}


def test_asynchronous_collective_longer_than_compute_exposes_the_rest():
    """No future callback before the wait: completion is where the wait ended; exposed = comm - compute."""
    clock = Clock()
    timers = CommTimers(clock=clock)
    token, work = start_async(timers, clock, Collective("a2a_combine", "combine", layer=0))
    clock.advance(4.0)  # compute
    wait(timers, clock, token, 6.0)
    work.future.finish()  # the callback that comes after the wait does not move the completion
    s = timers.summary()
    assert s.comm_ms["a2a_combine"] == pytest.approx(10.0)
    assert s.exposed_ms["a2a_combine"] == pytest.approx(6.0)
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
