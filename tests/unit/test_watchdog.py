"""The watchdog's reports (a fake clock and store) and the monitor's view of every collective (a world of one).

tests/faults/test_ranks.py and tests/distributed/test_watchdog.py stop a real rank; these check each branch of the
report and that the taps route megatron-core's collectives through `comm.issue` without changing them.
"""

import logging
import re
import threading
import time
import types

import pytest
import torch

from megatron_moe import comm
from megatron_moe.comm import Collective
from megatron_moe.comm import watchdog as watchdog_module
from megatron_moe.comm.watchdog import Watchdog
from megatron_moe.config import parse_args, rules

pytestmark = pytest.mark.quiet_cores  # wall-clock bounds of milliseconds


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class FakeStore:
    """The heartbeat store in memory: what `publish` wrote, `read` returns."""

    def __init__(self):
        self.beats = {}

    def publish(self, rank, beat):
        self.beats[rank] = dict(beat)

    def read(self, ranks):
        return {r: self.beats[r] for r in ranks if r in self.beats}


def make(store=None, stall=20.0, deadline=60.0):
    ended, clock = [], Clock()
    watchdog = Watchdog(
        stall_s=stall,
        deadline_s=deadline,
        end_job=ended.append,
        store=store,
        rank=0,
        clock=clock,
        ranks_of=lambda group: [0, 1] if group == "pair" else [0],
    )
    return watchdog, clock, ended


DISPATCH = Collective("a2a_dispatch", "dispatch_all_to_all", "pair", layer=3, nbytes=4096)


def advance(watchdog, clock, seconds):
    """Let time pass in periods, as the watchdog's thread would see it."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now = min(end, clock.now + watchdog.period)
        watchdog.check()


def peer_beat(store, *, seq, age_s, step=7, blocked=None):
    store.beats[1] = {"n": 1, "time": time.time() - age_s, "step": step, "seq": {"0,1": seq}, "blocked": blocked}


def test_a_stall_names_the_collective_and_the_peer_that_has_not_arrived(caplog):
    store = FakeStore()
    watchdog, clock, ended = make(store)
    watchdog.set_step(7)
    for _ in range(4):  # four earlier collectives on the pair
        token = watchdog.issued(Collective("a2a_combine", "combine_all_to_all", "pair", layer=2))
        watchdog.blocked(token)
        watchdog.unblocked(token, completed=True)
    token = watchdog.issued(DISPATCH)
    watchdog.blocked(token)
    peer_beat(store, seq=4, age_s=25)  # rank 1 stopped before reaching collective #5
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        advance(watchdog, clock, 19)
        assert "blocked" not in caplog.text
        advance(watchdog, clock, 1)
    (line,) = [r.getMessage() for r in caplog.records if "blocked" in r.getMessage()]
    assert line.startswith("rank 0: blocked 20 s in collective a2a_dispatch dispatch_all_to_all #5 on ranks [0, 1]")
    assert "(step 7, MoE layer 3)" in line and "4096 bytes" in line
    assert "not arrived: rank 1 (no heartbeat for 25 s: stopped or hung; last seen at step 7, computing)" in line
    assert store.beats[0]["seq"] == {"0,1": 5} and "dispatch_all_to_all #5" in store.beats[0]["blocked"]
    assert ended == []
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        watchdog.unblocked(token, completed=True)
    assert "dispatch_all_to_all #5 on ranks [0, 1] (step 7, MoE layer 3) went through after 20 s" in caplog.text


@pytest.mark.parametrize(
    "seq, age_s, expected",
    [
        (1, 0, "every peer arrived and is alive: the transfer itself is stalled"),
        (1, 60, "every peer arrived, but ranks [1] send no heartbeat (stopped or hung inside it)"),
        (0, 0, "not arrived: rank 1 (step 9, blocked in tp sum_across_shards"),
    ],
)
def test_what_the_peers_are_doing_is_reported(caplog, seq, age_s, expected):
    store = FakeStore()
    watchdog, clock, _ = make(store)
    watchdog.blocked(watchdog.issued(DISPATCH))
    peer_beat(store, seq=seq, age_s=age_s, step=9, blocked="tp sum_across_shards #3 on ranks [0, 1] (step 9)")
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        advance(watchdog, clock, 21)
    assert expected in caplog.text


def test_without_a_store_the_collective_is_still_named(caplog):
    watchdog, clock, _ = make(store=None)
    watchdog.blocked(watchdog.issued(DISPATCH))
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        advance(watchdog, clock, 21)
    assert "dispatch_all_to_all #1 on ranks [0, 1]" in caplog.text and "peers unknown" in caplog.text


def test_the_deadline_ends_the_job_with_the_report(caplog):
    store = FakeStore()
    watchdog, clock, ended = make(store, stall=20, deadline=60)
    watchdog.blocked(watchdog.issued(DISPATCH))
    peer_beat(store, seq=0, age_s=100)
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        advance(watchdog, clock, 59)
        assert ended == [] and caplog.text.count("rank 0: blocked") == 2  # at 20 s and 40 s
        advance(watchdog, clock, 1)
    (report,) = ended
    assert report.startswith("rank 0: blocked 60 s in collective a2a_dispatch dispatch_all_to_all #1")
    assert "not arrived: rank 1" in report and report.endswith("--distributed-timeout-minutes=1 passed")


def test_a_rank_that_was_stopped_itself_blames_no_one(caplog):
    store = FakeStore()
    watchdog, clock, ended = make(store)
    watchdog.blocked(watchdog.issued(DISPATCH))
    peer_beat(store, seq=1, age_s=0)
    watchdog.check()
    clock.now += 100  # SIGSTOP'd for 100 s: the thread did not run
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        watchdog.check()
    assert "this process did not run for 100 s" in caplog.text and "blocked" not in caplog.text
    assert ended == []


def test_a_collective_that_does_not_block_is_never_reported(caplog):
    watchdog, clock, ended = make(FakeStore())
    token = watchdog.issued(DISPATCH)  # started asynchronously, not waited for yet
    watchdog.unblocked(token, completed=False)
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        advance(watchdog, clock, 100)
    assert caplog.text == "" and ended == []


def test_the_thread_runs_and_stops():
    store = FakeStore()
    watchdog = Watchdog(stall_s=1, deadline_s=2, end_job=print, store=store, rank=0).start()
    time.sleep(0.1)
    watchdog.stop()
    assert store.beats[0]["n"] >= 1 and not any(t.name == "megatron_moe-watchdog" for t in threading.enumerate())


def test_a_step_is_published_when_it_starts_not_a_period_later():
    """A rank stopped at step 6 was reported "last seen at step 0, 1 or 3": its heartbeat
    carried the step of the last periodic beat (every 10 s at the default stall settings), not the step it ran."""
    store = FakeStore()
    watchdog = Watchdog(stall_s=40, deadline_s=600, end_job=print, store=store, rank=0).start()
    try:
        assert watchdog.period == 10
        time.sleep(0.2)
        for step in range(1, 7):
            watchdog.set_step(step)
            time.sleep(0.2)
        assert store.beats[0]["step"] == 6, store.beats[0]
    finally:
        watchdog.stop()


def stopped_peer_run(monkeypatch, caplog, *, stall_s, deadline_s, dead_s):
    """Rank 1 stops (last beat at t=0, before the collective) while rank 0 is blocked in it from t=0; the
    watchdog's thread runs every period on a fake clock (wall time too). Returns (seconds to the first report,
    seconds to the end of the job, the end report)."""
    clock = Clock()
    start = clock.now
    monkeypatch.setattr(watchdog_module, "time", types.SimpleNamespace(time=clock, monotonic=clock))
    store, ended = FakeStore(), []
    watchdog = Watchdog(
        stall_s=stall_s, deadline_s=deadline_s, dead_s=dead_s, end_job=ended.append, store=store, rank=0,
        clock=clock, ranks_of=lambda group: [0, 1],
    )  # fmt: skip
    store.beats[1] = {"n": 1, "time": clock.now, "step": 7, "seq": {"0,1": 0}, "blocked": None}
    watchdog.set_step(7)
    watchdog.blocked(watchdog.issued(DISPATCH))
    named = None
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        while not ended and clock.now - start < deadline_s + 60:
            clock.now += watchdog.period
            watchdog.check()
            if named is None and "rank 0: blocked" in caplog.text:
                named = clock.now - start
    return named, clock.now - start, ended[0] if ended else ""


def test_the_default_flags_name_a_stopped_rank_within_60_s_and_end_the_job_within_3_minutes(monkeypatch, caplog):
    """At the defaults a stopped rank was first named after 122 s, and the job ended at the
    10-minute --distributed-timeout-minutes."""
    p = parse_args(["--data-path", "d", "--tokenizer-model", "t.model"]).parallel
    rules.check_stall_seconds(p)
    assert (p.distributed_timeout_minutes, p.stall_report_seconds, p.dead_peer_seconds) == (10, 30, 150)
    named, ended, report = stopped_peer_run(
        monkeypatch, caplog, stall_s=p.stall_report_seconds, deadline_s=60 * p.distributed_timeout_minutes,
        dead_s=p.dead_peer_seconds,
    )  # fmt: skip
    assert named is not None and named <= 60, (named, caplog.text)
    assert "not arrived: rank 1 (no heartbeat for " in caplog.text and "last seen at step 7" in caplog.text
    assert ended <= 180, (ended, report)
    assert report.startswith("rank 0: blocked ") and "not arrived: rank 1 (no heartbeat for " in report, report
    assert report.endswith("ranks [1] sent no heartbeat for 150 s or more (--dead-peer-seconds=150): stopped, "
                           "hung or dead"), report  # fmt: skip


def test_a_live_peer_in_a_slow_collective_waits_for_the_deadline(caplog):
    store = FakeStore()
    watchdog, clock, ended = make(store, stall=2, deadline=30)
    watchdog.dead_s = 10
    watchdog.blocked(watchdog.issued(DISPATCH))
    for _ in range(int(29 / watchdog.period)):
        peer_beat(store, seq=1, age_s=0)  # arrived, and beating
        clock.now += watchdog.period
        watchdog.check()
    assert ended == []
    advance(watchdog, clock, 1)
    assert ended and ended[0].endswith("--distributed-timeout-minutes=0.5 passed")


class Recorder:
    """A monitor that keeps every event."""

    def __init__(self):
        self.events, self.bytes = [], {}

    def issued(self, collective):
        self.events.append(("issued", collective.kind, collective.purpose))
        self.bytes[collective.purpose] = collective.nbytes
        return collective

    def handle(self, token, work):
        self.events.append(("handle", token.purpose))

    def blocked(self, token):
        self.events.append(("blocked", token.purpose))

    def unblocked(self, token, *, completed):
        self.events.append(("unblocked", token.purpose, completed))

    def read_started(self, read):
        self.events.append(("read", read.purpose))
        return read

    def read_ended(self, token):
        self.events.append(("read ended", token.purpose))


def test_issue_shows_synchronous_and_asynchronous_collectives_to_the_monitor(megatron_world1):
    import torch.distributed as dist

    x = torch.ones(4)
    with comm.monitoring(Recorder()) as recorder:
        comm.issue(Collective("other", "sync"), lambda: dist.all_reduce(x))
        work = comm.issue(Collective("other", "async"), lambda: dist.all_reduce(x, async_op=True))
        work.wait()
        work.wait()  # waited once: a gloo send/recv waited twice would block
        with comm.monitoring(Recorder()) as second:  # a second monitor beside the first
            comm.issue(Collective("tp", "both"), lambda: dist.all_reduce(x))
    assert second.events == [("issued", "tp", "both"), ("blocked", "both"), ("unblocked", "both", True)]
    assert recorder.events[:9] == [
        ("issued", "other", "sync"),
        ("blocked", "sync"),
        ("unblocked", "sync", True),
        ("issued", "other", "async"),
        ("blocked", "async"),
        ("handle", "async"),
        ("unblocked", "async", False),
        ("blocked", "async"),
        ("unblocked", "async", True),
    ]
    assert recorder.events[9:] == second.events
    comm.issue(Collective("other", "unwatched"), lambda: dist.all_reduce(x))  # no monitor: nothing recorded
    assert len(recorder.events) == 12


def test_megatron_core_collectives_reach_the_monitor_unchanged(megatron_world1):
    """A training step of megatron-core's DDP and optimizer: its bucket grad reduce and grad-norm all-reduce
    are issued through `comm.issue` (kinds dp_grad_reduce, other), and the step's result is the same."""
    from megatron_moe.comm.megatron_core import tap_megatron_core

    def step(tapped: bool):
        from megatron_moe.training.initialize import set_seed
        from tests.unit.test_checkpoint_safety import Run

        set_seed(0)
        run = Run("/nonexistent", flags=("--use-distributed-optimizer",))
        tokens = torch.randint(0, 128, (2, 32))
        position_ids = torch.arange(32).expand(2, 32)
        with comm.monitoring(Recorder()) if tapped else _null() as recorder:
            loss = run.model[0](tokens, position_ids, None, labels=tokens).float().mean()
            loss.backward()
            run.model[0].finish_grad_sync()
            _, grad_norm, _ = run.optimizer.step()
        return recorder, grad_norm, run.weights()

    _, plain_norm, plain_weights = step(tapped=False)
    tap_megatron_core()
    recorder, norm, weights = step(tapped=True)
    issued = {(e[1], e[2]) for e in recorder.events if e[0] == "issued"}
    assert ("dp_grad_reduce", "megatron-core/start_grad_sync") in issued, issued
    assert ("other", "megatron-core/start_param_sync") in issued, issued
    # The grad norm's all-reduce is over a group of one rank here: done locally, not issued (test below).
    assert ("other", "torch.distributed.all_reduce") not in issued, issued
    assert recorder.bytes["megatron-core/start_grad_sync"] == 0  # a data-parallel group of one sends nothing
    blocked = [e for e in recorder.events if e[0] == "blocked"]
    assert len(blocked) == len([e for e in recorder.events if e[0] == "unblocked"])
    assert norm == plain_norm and all(torch.equal(a, b) for a, b in zip(weights, plain_weights))


def test_a_group_of_one_rank_issues_no_collective(megatron_world1):
    """At TP=1 megatron-core's cross-entropy still all-reduces over the TP group (3 times a micro-batch), and a
    TP=1 run showed `tp` traffic. A tapped collective on a group of one rank is done locally: nothing issued,
    nothing recorded, the same result."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_moe.comm.megatron_core import tap_megatron_core

    tap_megatron_core()
    tp = parallel_state.get_tensor_model_parallel_group()
    x = torch.arange(6.0)
    gathered, scattered, exchanged, listed, objects = torch.empty(6), torch.empty(6), torch.empty(6), [None], [None]
    listed[0] = torch.empty(6)
    recorder = Recorder()
    with comm.monitoring(recorder):
        dist.all_reduce(x, group=tp)
        dist.all_gather_into_tensor(gathered, x, group=tp, async_op=True).wait()
        dist.reduce_scatter_tensor(scattered, x * 2, group=tp)
        dist.all_to_all_single(exchanged, x * 3, group=tp)
        dist.all_gather(listed, x * 4, group=tp)
        dist.all_gather_object(objects, {"rank": 0}, group=tp)
        dist.broadcast(x, 0, group=tp)
        dist.barrier(group=tp)
        logits, target = torch.randn(4, 2, 16), torch.randint(0, 16, (4, 2))
        loss = vocab_parallel_cross_entropy(logits.clone(), target)
    assert recorder.events == []
    assert torch.equal(x, torch.arange(6.0)) and torch.equal(gathered, x) and torch.equal(scattered, 2 * x)
    assert torch.equal(exchanged, 3 * x) and torch.equal(listed[0], 4 * x) and objects == [{"rank": 0}]
    expected = F.cross_entropy(logits.view(-1, 16), target.view(-1), reduction="none").view(4, 2)
    assert torch.allclose(loss, expected, atol=1e-6)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_a_store_that_is_gone_is_one_warning_and_the_collective_is_still_named(caplog):
    """Before: `heartbeats off, peers will not be reported`, for the rest of the run (tests/unit/
    test_watchdog_slow_links.py: the store is retried and comes back). A store that reads but takes no writes is one
    outage, not one a round (before: each peer read that answered ended it, and the next write began another; CI
    saw two lines in 0.6 s)."""

    class GoneStore(FakeStore):
        def publish(self, rank, beat):
            raise RuntimeError("Broken pipe")

    watchdog = Watchdog(stall_s=0.2, deadline_s=100, end_job=print, store=GoneStore(), rank=0, ranks_of=lambda g: [0])
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        watchdog.blocked(watchdog.issued(Collective("other", "barrier/x")))
        watchdog.start()
        time.sleep(1.3)  # 5 rounds: it reads peers from the second on
        watchdog.stop()
    assert caplog.text.count("heartbeat store not answering (Broken pipe); retrying") == 1
    assert "answering again" not in caplog.text
    assert "heartbeats off" not in caplog.text and "blocked" in caplog.text


# -- host reads: where a stuck peer shows on NCCL ---------------------------------------------
#
# NCCL's `wait()` only orders the compute stream, so the host goes on past a collective a peer never joined and
# blocks in its next read of a device value. The watchdog names that read and the last collective issued on each
# group (the unfinished one is among them), with the group's peers that have not arrived.


def make_groups(store=None, stall=20.0, deadline=60.0):
    ended, clock = [], Clock()
    ranks = {"ep": [0, 1], "dp": [0, 2], "tp": [0]}
    names = {"ep": "expert_model_parallel", "dp": "data_parallel"}
    watchdog = Watchdog(
        stall_s=stall,
        deadline_s=deadline,
        end_job=ended.append,
        store=store,
        rank=0,
        clock=clock,
        ranks_of=lambda group: ranks[group],
        name_of=names.get,
    )
    return watchdog, clock, ended


def run_collective(watchdog, collective):
    """Issued and waited for: on NCCL the wait returns at once, the transfer may still be running."""
    token = watchdog.issued(collective)
    watchdog.blocked(token)
    watchdog.unblocked(token, completed=True)


def test_a_host_read_that_blocks_names_the_read_and_the_last_collective_of_each_group(caplog):
    store = FakeStore()
    watchdog, clock, ended = make_groups(store)
    watchdog.set_step(6)
    run_collective(watchdog, Collective("dp_grad_reduce", "megatron-core/start_grad_sync", "dp", nbytes=64))
    watchdog.set_step(7)
    run_collective(watchdog, Collective("a2a_combine", "combine_all_to_all", "ep", layer=1))
    run_collective(watchdog, Collective("a2a_dispatch", "exchange_counts", "ep", layer=2))
    run_collective(watchdog, Collective("tp", "sum_across_shards", "tp"))  # a group of one: waits for no one
    store.beats[1] = {"n": 3, "time": time.time() - 25, "step": 7, "seq": {"0,1": 1}, "blocked": None}
    store.beats[2] = {"n": 9, "time": time.time(), "step": 7, "seq": {"0,2": 1}, "blocked": "host read 'lm loss'"}
    token = watchdog.read_started(comm.HostRead("moe plan counts", layer=2))
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        advance(watchdog, clock, 19)
        assert "blocked" not in caplog.text
        advance(watchdog, clock, 1)
    (line,) = [r.getMessage() for r in caplog.records if "blocked" in r.getMessage()]
    assert line == (
        "rank 0: blocked 20 s in host read 'moe plan counts' (step 7, MoE layer 2), waiting for the device; "
        "last collectives issued: "
        "expert_model_parallel group, ranks [0, 1]: a2a_dispatch exchange_counts #2 (step 7, MoE layer 2), "
        "not arrived: rank 1 (no heartbeat for 25 s: stopped or hung; last seen at step 7, computing); "
        "data_parallel group, ranks [0, 2]: dp_grad_reduce megatron-core/start_grad_sync #1 (step 6), "
        "every peer arrived"
    )
    assert store.beats[0]["blocked"] == "host read 'moe plan counts' (step 7, MoE layer 2)"  # what peers see
    advance(watchdog, clock, 40)
    (report,) = ended
    assert report.startswith("rank 0: blocked 60 s in host read 'moe plan counts' (step 7, MoE layer 2)")
    assert "exchange_counts #2 (step 7, MoE layer 2), not arrived: rank 1" in report
    assert report.endswith("--distributed-timeout-minutes=1 passed")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        watchdog.read_ended(token)
    assert "rank 0: host read 'moe plan counts' (step 7, MoE layer 2) went through after 60 s" in caplog.text


def test_a_collective_inside_a_host_read_is_named_and_the_read_is_watched_again_after_it(caplog):
    """megatron-core's optimizer step: the grad-norm all-reduce inside it, then its `.item()`."""
    watchdog, clock, ended = make_groups(FakeStore())
    read = watchdog.read_started(comm.HostRead("optimizer step (found-inf, grad norm)"))
    token = watchdog.issued(Collective("other", "torch.distributed.all_reduce", "dp"))
    watchdog.blocked(token)
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        advance(watchdog, clock, 20)
    assert "blocked 20 s in collective other torch.distributed.all_reduce #1 on ranks [0, 2]" in caplog.text
    assert "host read" not in caplog.text  # the innermost wait is named, not the read around it
    watchdog.unblocked(token, completed=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        advance(watchdog, clock, 19)  # the read's clock restarted when the all-reduce went through
        assert "blocked" not in caplog.text
        advance(watchdog, clock, 1)
    assert "rank 0: blocked 20 s in host read 'optimizer step (found-inf, grad norm)' (step 0)" in caplog.text
    assert "data_parallel group, ranks [0, 2]: other torch.distributed.all_reduce #1 (step 0)" in caplog.text
    watchdog.read_ended(read)
    advance(watchdog, clock, 100)
    assert ended == []


def test_a_read_before_any_collective_with_a_peer_says_so(caplog):
    watchdog, clock, _ = make_groups(store=None)
    watchdog.read_started(comm.HostRead("lm loss"))
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        advance(watchdog, clock, 20)
    assert "host read 'lm loss' (step 0), waiting for the device; no collective issued with another rank" in (
        caplog.text
    )


def test_the_moe_layers_plan_read_blocked_on_the_device_ends_the_job_with_its_name():
    """The real thread, the MoE layer's own host read, and a device read that blocks (as on a GPU, where the
    copy waits for the peer's counts exchange): past the deadline the job ends with the read named."""
    import megatron_moe.moe.layer as layer_module
    from tests.unit.test_host_sync import H, _layer

    class PeerAlive(FakeStore):
        def read(self, ranks):  # rank 1 publishes every period: alive, at step 3, its count on [0, 1] still 0
            return {1: {"n": 1, "time": time.time(), "step": 3, "seq": {}, "blocked": None}}

    class Group:  # what megatron-core's parallel_state makes: a process group with a description
        group_desc = "EXPERT_MODEL_PARALLEL_GROUP"

    ep = Group()
    store, ended, released = PeerAlive(), [], threading.Event()

    def end_job(report):
        ended.append(report)
        released.set()  # the test's stand-in for exiting the process

    watchdog = Watchdog(
        stall_s=0.3,
        deadline_s=1.0,
        end_job=end_job,
        store=store,
        rank=0,
        ranks_of=lambda group: [0, 1] if group is ep else [0],
    )
    real_to_host = layer_module.to_host

    def device_read(*tensors):
        released.wait(timeout=5)  # the device has not finished the counts exchange: a peer never joined it
        return real_to_host(*tensors)

    layer = _layer()
    layer.set_layer_number(2)
    layer_module.to_host = device_read
    try:
        with comm.monitoring(watchdog.start()):
            watchdog.set_step(3)
            # The counts exchange the layer issues at EP > 1 (one rank here): started, its wait did not block.
            comm.issue(Collective("a2a_dispatch", "exchange_counts", ep, layer=2), lambda: None)
            layer(torch.randn(4, 2, H))
    finally:
        layer_module.to_host = real_to_host
        watchdog.stop()
    assert ended, "the watchdog did not fire while the device read blocked"
    assert re.match(
        r"rank 0: blocked 1 s in host read 'moe plan counts' \(step 3, MoE layer 2\), waiting for the device; "
        r"last collectives issued: expert_model_parallel group, ranks \[0, 1\]: a2a_dispatch exchange_counts #1 "
        r"\(step 3, MoE layer 2\), not arrived: rank 1 \(step 3, computing\)",
        ended[0],
    ), ended[0]
