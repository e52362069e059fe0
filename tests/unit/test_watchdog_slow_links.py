"""Slow is not dead: a heartbeat store that times out is retried (never switched off), and a peer whose
collectives complete, or whose heartbeats arrive late, is reported slow and never taken for a dead one.

A fake clock (wall time too) and a fake store; the emulated cluster's throttled and cut links are in
tests/faults/test_slow_links.py.

Before: one store timeout printed torch's 15-line C++ stack and `heartbeats off, peers will not be reported`, for
the rest of the run; a live peer behind a slow link (its heartbeats late, its collectives completing) was ended
as "stopped, hung or dead" at --dead-peer-seconds.
"""

import logging
import types

from megatron_moe.comm import Collective
from megatron_moe.comm import watchdog as watchdog_module
from megatron_moe.comm.watchdog import Watchdog

DISPATCH = Collective("a2a_dispatch", "dispatch_all_to_all", "pair", layer=3, nbytes=4096)
TIMEOUT = (
    "Timeout: socket timed out after 1000ms (heartbeat beat/1)\n"
    "Exception raised from recvBytes at ../torch/csrc/distributed/c10d/Utils.hpp:667 (most recent call first):\n"
    "frame #0: c10::Error::Error(...) + 0x96 (0x7f in libc10.so)\n"
    "frame #1: <unknown function> + 0x5d0 (0x7f in libtorch_cpu.so)"
)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class FlakyStore:
    """The heartbeat store in memory, whose calls fail while `down` (as a client's on a throttled link)."""

    def __init__(self):
        self.beats, self.down, self.calls = {}, False, 0

    def publish(self, rank, beat):
        self.calls += 1
        if self.down:
            raise RuntimeError(TIMEOUT)
        self.beats[rank] = dict(beat)

    def read(self, ranks):
        if self.down:
            raise RuntimeError(TIMEOUT)
        return {r: dict(self.beats[r]) for r in ranks if r in self.beats}


def watched(monkeypatch, *, stall_s=2.0, deadline_s=60.0, dead_s=6.0):
    """(watchdog of rank 0 on a fake clock, the clock, the store, the reports that ended the job)."""
    clock = Clock()
    monkeypatch.setattr(watchdog_module, "time", types.SimpleNamespace(time=clock, monotonic=clock))
    store, ended = FlakyStore(), []
    watchdog = Watchdog(
        stall_s=stall_s, deadline_s=deadline_s, dead_s=dead_s, end_job=ended.append, store=store, rank=0,
        clock=clock, ranks_of=lambda group: [0, 1],
    )  # fmt: skip
    return watchdog, clock, store, ended


def beat_of_rank_1(store, clock, *, n, age_s=0.0, seq=0):
    store.beats[1] = {"n": n, "time": clock.now - age_s, "step": 4, "seq": {"0,1": seq}, "blocked": None}


def test_a_store_timeout_is_one_line_and_the_heartbeats_go_on(monkeypatch, caplog):
    watchdog, clock, store, ended = watched(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        watchdog.check()
        first = store.beats[0]["n"]
        store.down = True
        for _ in range(20):  # 10 s of timeouts, a round every period
            clock.now += watchdog.period
            watchdog.check()  # before: raised, and the thread switched the heartbeats off for good
        store.down = False
        clock.now += watchdog.period
        watchdog.check()
    assert store.beats[0]["n"] > first  # published again once the store answers
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "rank 0: watchdog: heartbeat store not answering (Timeout: socket timed out after 1000ms (heartbeat "
        "beat/1)); retrying",
        "rank 0: watchdog: heartbeat store answering again after 10 s",
    ], warnings  # one line each, no C++ stack, never "heartbeats off"
    assert ended == []


def test_a_rank_cut_off_from_the_store_judges_no_one_dead_and_ends_at_the_deadline(monkeypatch, caplog):
    watchdog, clock, store, ended = watched(monkeypatch, stall_s=2, deadline_s=30, dead_s=6)
    beat_of_rank_1(store, clock, n=1)
    watchdog.blocked(watchdog.issued(DISPATCH))
    watchdog.check()
    store.down = True  # this rank's link to the store: no news of anyone is no evidence against them
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        while not ended and clock.now < 1000 + 40:
            clock.now += watchdog.period
            watchdog.check()
    (report,) = ended
    assert report.endswith("--distributed-timeout-minutes=0.5 passed"), report
    assert "peers unknown (the heartbeat store has not answered for " in report, report
    assert "stopped, hung or dead" not in caplog.text + report


def test_a_peer_whose_collectives_complete_is_slow_not_dead(monkeypatch, caplog):
    """Rank 1's heartbeats stop reaching the store (its link is throttled) while the collectives with it still
    complete, each after 4 s: past --dead-peer-seconds 6 it is reported slow, and the job goes on."""
    watchdog, clock, store, ended = watched(monkeypatch, stall_s=2, deadline_s=60, dead_s=6)
    beat_of_rank_1(store, clock, n=1)  # its last heartbeat that got through
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        for seq in range(1, 11):  # 40 s of collectives, each waiting 4 s for the slow link
            token = watchdog.issued(DISPATCH)
            watchdog.blocked(token)
            store.beats[1]["seq"] = {"0,1": seq}  # rank 1 is in it too (as its heartbeat would say, if it arrived)
            for _ in range(int(4 / watchdog.period)):
                clock.now += watchdog.period
                watchdog.check()
            watchdog.unblocked(token, completed=True)
    assert ended == [], ended  # before: "ranks [1] sent no heartbeat for 6 s or more ...: stopped, hung or dead"
    reports = [r.getMessage() for r in caplog.records if "blocked" in r.getMessage()]
    assert reports and "ranks [1] are slow, not dead (late heartbeats): the link is slow" in reports[-1], reports
    assert "stopped or hung" not in reports[-1], reports[-1]


def test_late_heartbeats_keep_a_peer_alive_and_silence_still_ends_the_job(monkeypatch):
    """Rank 1's heartbeats arrive 20 s after it sent them (a deep queue on a throttled link): each new one is
    news, so it is alive; once nothing more arrives, --dead-peer-seconds ends the job, naming it."""
    watchdog, clock, store, ended = watched(monkeypatch, stall_s=2, deadline_s=120, dead_s=6)
    watchdog.blocked(watchdog.issued(DISPATCH))
    beat_of_rank_1(store, clock, n=0)  # before the link slowed down: on time
    for _ in range(int(2 / watchdog.period)):
        clock.now += watchdog.period
        watchdog.check()
    for n in range(1, 16):  # 30 s, a late heartbeat every 2 s
        beat_of_rank_1(store, clock, n=n, age_s=20.0)
        for _ in range(int(2 / watchdog.period)):
            clock.now += watchdog.period
            watchdog.check()
    assert ended == [], ended
    cut = clock.now
    while not ended and clock.now < cut + 10:  # nothing arrives any more (the link is down, or rank 1 is)
        clock.now += watchdog.period
        watchdog.check()
    (report,) = ended
    assert clock.now - cut <= 6 + watchdog.period, clock.now - cut
    assert "ranks [1] sent no heartbeat for 6 s or more (--dead-peer-seconds=6): stopped, hung or dead" in report
