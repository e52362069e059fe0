"""The watchdog: names the collective (or the read of device values) a rank is stuck in, and the peers that have
not arrived.

A `Monitor` (core.py) plus one daemon thread per rank. The monitor counts the collectives issued per process
group and what each thread is blocked on (a collective or a `core.host_read`). Every `period` seconds, and at
once when a step starts, the thread publishes this rank's heartbeat to the rendezvous store; past half the stall
threshold it reads the group's heartbeats; past the threshold it logs the report (kind, purpose, layer, step,
group, bytes, and each peer's arrival and liveness); a peer with no sign of life (a heartbeat, a late one, a
collective completed with it) for `dead_s` (--dead-peer-seconds), or the deadline (--distributed-timeout-minutes),
ends the job (`end_job`); a store that does not answer (a slow link) is retried, never given up. Invariant: the
process groups' own timeouts are a minute later, so this named report comes before gloo's or NCCL's anonymous one.
The steps in full, and how a rank stuck on NCCL is found in its host read: docs/internals/comm.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from megatron_moe.comm.core import Collective, HostRead

log = logging.getLogger("megatron_moe")


def group_ranks(group) -> list[int]:
    """Global ranks of `group` (None: the world)."""
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def group_name(group) -> str | None:
    """What `group` is, from megatron-core's description of it (`EXPERT_MODEL_PARALLEL_GROUP` ->
    `expert_model_parallel`); None when it has none."""
    if group is None:
        return "world"
    desc = getattr(group, "group_desc", "") or ""
    if desc in ("", "undefined"):
        return None
    return "world" if desc == "default_pg" else desc.lower().removesuffix("_group")


@dataclasses.dataclass(eq=False)  # tokens are told apart by identity
class _Blocked:
    """A collective issued on this rank, and (while a thread waits for it) since when."""

    collective: Collective
    ranks: tuple[int, ...]
    seq: int
    """Its number among the collectives issued on its group (1 = the first)."""
    step: int
    order: int = 0
    """Its number among every collective this rank issued (the latest is the highest)."""
    group_name: str | None = None
    since: float | None = None
    reported: int = 0
    """How many stall reports it has had."""


@dataclasses.dataclass(eq=False)
class _Reading:
    """A read of device values by the host (`core.host_read`) running on a thread, and since when."""

    read: HostRead
    step: int
    since: float | None = None
    """When the thread started waiting in it: when it opened, or when the last collective inside it ended."""
    reported: int = 0


class HeartbeatStore:
    """This job's heartbeats in the rendezvous store: our own client, so a stopped or slow store host cannot hang
    the watchdog's thread for longer than `timeout_s` (the process group's client keeps its own timeout). A call
    that fails drops the client (a timed-out one may still hold half a reply); the next call connects again."""

    def __init__(self, prefix: str, timeout_s: float = 5.0):
        self._prefix, self._timeout_s = prefix, timeout_s
        self._store = None
        self._client()

    def _client(self):
        if self._store is None:
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=self._timeout_s),
                wait_for_workers=False,
            )
            self._store = dist.PrefixStore(self._prefix, store)
        return self._store

    def _call(self, use):
        try:
            return use(self._client())
        except Exception:
            self._store = None
            raise

    def publish(self, rank: int, beat: dict) -> None:
        self._call(lambda store: store.set(f"beat/{rank}", json.dumps(beat)))

    def read(self, ranks) -> dict[int, dict]:
        def read(store):
            present = [r for r in ranks if store.check([f"beat/{r}"])]
            return {r: json.loads(store.get(f"beat/{r}")) for r in present}

        return self._call(read)


def job_prefix() -> str:
    """Heartbeat keys of this job attempt only (torchrun's run id and restart count)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"megatron_moe/watchdog/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


class Watchdog:
    """A `Monitor` that reports stalled collectives and ends the job at the deadline.

    `end_job(report)` is called once, from the watchdog's thread, when a collective or a host read is blocked
    past `deadline_s`, or while a peer it waits for has sent no heartbeat for `dead_s` (None: no such rule); it
    must end the process (the training entry point exits at once, without collectives).
    `store` holds the heartbeats (None: peers are not reported); `clock`, `ranks_of` (a process group's
    global ranks) and `name_of` (what the group is) are replaceable for tests.
    """

    def __init__(
        self,
        *,
        stall_s: float,
        deadline_s: float,
        dead_s: float | None = None,
        end_job: Callable[[str], None],
        store: HeartbeatStore | None,
        rank: int,
        clock: Callable[[], float] = time.monotonic,
        ranks_of: Callable[[object], list[int]] = group_ranks,
        name_of: Callable[[object], str | None] = group_name,
    ):
        assert 0 < stall_s < deadline_s, (stall_s, deadline_s)
        self.stall_s, self.deadline_s, self.rank = stall_s, deadline_s, rank
        self.period = min(max(stall_s / 4, 0.25), 10.0)
        # A beat older than this is not jitter: the peer is not running (`_peer_status` says so).
        self.silent_s = 2 * self.period + 1
        # Never below the silence threshold: a live peer between two beats is not taken for a dead one.
        self.dead_s = None if dead_s is None else max(dead_s, self.silent_s)
        self._end_job, self._store, self._clock, self._ranks_of = end_job, store, clock, ranks_of
        self._name_of = name_of
        self._lock = threading.Lock()
        self._seq: dict[tuple[int, ...], int] = {}
        self._last: dict[tuple[int, ...], _Blocked] = {}  # group's ranks -> the last collective issued on it
        self._issued = 0
        self._waiting: dict[int, list[_Blocked | _Reading]] = {}  # thread id -> what it waits for, innermost last
        self._beats: dict[int, dict] = {}
        self._news: dict[int, float] = {}  # rank -> when a new heartbeat of it was last read (`clock`)
        self._completed: dict[int, float] = {}  # rank -> when a collective with it last completed here (`clock`)
        self._store_down: dict[str, float] = {}  # store call ("publish", "read") -> time.monotonic() of its outage's
        # first failure: per call, so a store that reads but does not take writes is one outage, not one a round
        self._step = 0
        self._counter = 0
        self._last_check: float | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # a step started: publish now
        self._thread = threading.Thread(target=self._run, name="megatron_moe-watchdog", daemon=True)

    # -- the Monitor protocol (called on the threads that communicate) --------------------------------------

    def issued(self, collective: Collective) -> _Blocked:
        ranks = tuple(self._ranks_of(collective.group))
        name = self._name_of(collective.group)
        with self._lock:
            seq = self._seq[ranks] = self._seq.get(ranks, 0) + 1
            self._issued += 1
            token = self._last[ranks] = _Blocked(collective, ranks, seq, self._step, self._issued, name)
            return token

    def handle(self, token: _Blocked, work) -> None:
        pass  # the watchdog watches threads blocked, not transfers

    def blocked(self, token: _Blocked) -> None:
        self._enter(token)

    def unblocked(self, token: _Blocked, *, completed: bool) -> None:
        if completed:  # every rank of the group took part: each was alive just now, however late its heartbeat
            self._completed.update(dict.fromkeys(token.ranks, self._clock()))
        self._leave(token)

    def read_started(self, read: HostRead) -> _Reading:
        token = _Reading(read, self._step)
        self._enter(token)
        return token

    def read_ended(self, token: _Reading) -> None:
        self._leave(token)

    def _enter(self, token: _Blocked | _Reading) -> None:
        token.since = self._clock()
        with self._lock:
            self._waiting.setdefault(threading.get_ident(), []).append(token)

    def _leave(self, token: _Blocked | _Reading) -> None:
        now = self._clock()
        with self._lock:
            stack = self._waiting.get(threading.get_ident(), [])
            if token in stack:
                stack.remove(token)
            if stack:  # a read the collective ran inside: it waits again from now
                stack[-1].since, stack[-1].reported = now, 0
            else:
                self._waiting.pop(threading.get_ident(), None)
        if token.reported:
            waited = now - token.since
            log.warning("rank %d: %s went through after %.0f s", self.rank, self._name(token), waited)
        token.since, token.reported = None, 0

    # -- the training loop ------------------------------------------------------------------------------------

    def set_step(self, step: int) -> None:
        """The step now running (named in reports, and published at once in this rank's heartbeat)."""
        if step != self._step:
            self._step = step
            self._wake.set()

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (not waited for long: it may be inside a store call to a peer that is gone)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=0.5)

    # -- the watchdog's thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self.check()
            # At most one round per 50 ms however short the steps: the store is shared by every rank.
            if self._stop.wait(0.05) or (self._wake.wait(self.period) and self._stop.is_set()):
                return
            self._wake.clear()

    def check(self) -> None:
        """One round (the thread calls it every `period`; tests call it directly)."""
        now = self._clock()
        with self._lock:
            waiting = [stack[-1] for stack in self._waiting.values() if stack]  # what each thread is blocked in
        self._publish(waiting)
        if self._last_check is not None and now - self._last_check > 2 * self.period + 1:
            # This process itself did not run (SIGSTOP, a suspended VM, CPU starvation): what it was
            # blocked on waited for it, not for a peer. Restart those clocks rather than blame the others.
            log.warning("rank %d: this process did not run for %.0f s (stopped?)", self.rank, now - self._last_check)
            for blocked in waiting:
                blocked.since = now if blocked.since is not None else None
        self._last_check = now
        for blocked in waiting:
            if blocked.since is None:
                continue
            waited = now - blocked.since
            if waited >= self.stall_s / 2:
                self._read_peers(self._peers_of(blocked))
                dead = self._dead_peers(blocked)
                if dead:
                    report = self.report(blocked, waited)
                    self._end_job(
                        f"{report}; ranks {dead} sent no heartbeat for {self.dead_s:g} s or more "
                        f"(--dead-peer-seconds={self.dead_s:g}): stopped, hung or dead"
                    )
                    return
            if waited >= self.deadline_s:
                report = self.report(blocked, waited)
                self._end_job(f"{report}; --distributed-timeout-minutes={self.deadline_s / 60:g} passed")
                return
            if waited >= self.stall_s * (blocked.reported + 1):
                blocked.reported += 1
                log.warning("%s", self.report(blocked, waited))

    def _publish(self, waiting: list[_Blocked]) -> None:
        if self._store is None:
            return
        self._counter += 1
        with self._lock:
            seq = {",".join(map(str, ranks)): n for ranks, n in self._seq.items()}
        blocked = next((self._name(b) for b in waiting if b.since is not None), None)
        beat = {"n": self._counter, "time": time.time(), "step": self._step, "seq": seq, "blocked": blocked}
        self._with_store("publish", lambda: self._store.publish(self.rank, beat))

    def _with_store(self, what: str, call) -> bool:
        """Run the store call `what`; a failure (a slow link's timeout, the store's host gone) is one line per
        outage of that call and leaves the heartbeats on: the next round reconnects. False: it did not answer."""
        try:
            call()
        except Exception as error:
            if not self._store_down:
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                log.warning("rank %d: watchdog: heartbeat store not answering (%s); retrying", self.rank, first)
            self._store_down.setdefault(what, time.monotonic())
            return False
        since = self._store_down.pop(what, None)
        if since is not None and not self._store_down:
            away = time.monotonic() - since
            log.warning("rank %d: watchdog: heartbeat store answering again after %.0f s", self.rank, away)
        return True

    @property
    def _store_down_since(self) -> float | None:
        """time.monotonic() of the current outage's first failed store call; None while every call answers."""
        return min(self._store_down.values(), default=None)

    def _peers_of(self, blocked: _Blocked | _Reading) -> list[int]:
        if isinstance(blocked, _Blocked):
            return list(blocked.ranks)
        with self._lock:
            return sorted({r for ranks in self._last for r in ranks})

    def _dead_peers(self, blocked: _Blocked | _Reading) -> list[int]:
        """The peers `blocked` waits for with no sign of life (`_silence`) for `dead_s` or more; none while the
        store does not answer this rank (no news is then no evidence)."""
        if self.dead_s is None or self._store is None or self._store_down_since is not None:
            return []
        peers = [r for r in self._peers_of(blocked) if r != self.rank]
        return [r for r in peers if r in self._beats and self._silence(r) >= self.dead_s]

    def _silence(self, rank: int) -> float:
        """Seconds since `rank` was last known alive: since its newest heartbeat's time (wall clocks), since a new
        heartbeat of it arrived (a slow link delivers them late), or since a collective with it completed here."""
        local = max(self._news.get(rank, -math.inf), self._completed.get(rank, -math.inf))
        return min(time.time() - self._beats[rank]["time"], self._clock() - local)

    def _read_peers(self, ranks) -> None:
        if self._store is None:
            return
        read: dict[int, dict] = {}
        if not self._with_store("read", lambda: read.update(self._store.read([r for r in ranks if r != self.rank]))):
            return
        now = self._clock()
        for rank, beat in read.items():
            if rank in self._beats and beat["n"] != self._beats[rank]["n"]:
                self._news[rank] = now
        self._beats.update(read)

    # -- the report -------------------------------------------------------------------------------------------

    @staticmethod
    def _where(step: int, layer: int | None) -> str:
        return ", ".join([f"step {step}"] + ([f"MoE layer {layer}"] if layer is not None else []))

    def _name(self, blocked: _Blocked | _Reading, *, ranks: bool = True) -> str:
        if isinstance(blocked, _Reading):
            return f"host read '{blocked.read.purpose}' ({self._where(blocked.step, blocked.read.layer)})"
        c = blocked.collective
        direction = " (backward)" if c.backward else ""
        on = f" on ranks {list(blocked.ranks)}" if ranks else ""
        return f"{c.kind} {c.purpose}{direction} #{blocked.seq}{on} ({self._where(blocked.step, c.layer)})"

    def report(self, blocked: _Blocked | _Reading, waited: float) -> str:
        """One line: the collective, how long, and each peer that has not arrived (when knowable). For a host
        read: what is read, how long, and for each group the last collective issued on it, the latest first."""
        if isinstance(blocked, _Reading):
            return self._read_report(blocked, waited)
        line = f"rank {self.rank}: blocked {waited:.0f} s in collective {self._name(blocked)}"
        if blocked.collective.nbytes:
            line += f", {blocked.collective.nbytes} bytes sent"
        return f"{line}; {self._peer_status(blocked)}"

    def _read_report(self, reading: _Reading, waited: float) -> str:
        line = f"rank {self.rank}: blocked {waited:.0f} s in {self._name(reading)}, waiting for the device"
        with self._lock:
            last = sorted(self._last.values(), key=lambda b: -b.order)
        groups = []
        for blocked in last:
            if len(blocked.ranks) < 2:
                continue  # a group of one rank waits for no one
            group = f"{blocked.group_name} group, " if blocked.group_name else ""
            status = self._peer_status(blocked, in_read=True)
            groups.append(f"{group}ranks {list(blocked.ranks)}: {self._name(blocked, ranks=False)}, {status}")
        if not groups:
            return f"{line}; no collective issued with another rank yet"
        return f"{line}; last collectives issued: " + "; ".join(groups)

    def _peer_status(self, blocked: _Blocked, *, in_read: bool = False) -> str:
        if self._store is None:
            return "peers unknown (no heartbeat store)"
        if self._store_down_since is not None:
            away = time.monotonic() - self._store_down_since
            return f"peers unknown (the heartbeat store has not answered for {away:.0f} s: a slow or broken link?)"
        peers = [r for r in blocked.ranks if r != self.rank]
        missing, silent, slow = [], [], []
        for rank in peers:
            beat = self._beats.get(rank)
            if beat is None:
                missing.append(f"rank {rank} (no heartbeat yet)")
                continue
            arrived = beat["seq"].get(",".join(map(str, blocked.ranks)), 0) >= blocked.seq
            quiet, sign = time.time() - beat["time"], self._silence(rank)  # wall: hosts agree to well under a period
            state = f"step {beat['step']}, " + (f"blocked in {beat['blocked']}" if beat["blocked"] else "computing")
            if quiet >= self.silent_s and arrived and sign < quiet:  # in it, collectives completing: slow, alive
                slow.append(rank)
                state = f"heartbeat {quiet:.0f} s old but alive {sign:.0f} s ago: slow, not dead; last seen at {state}"
            elif quiet >= self.silent_s:
                silent.append(rank)
                state = f"no heartbeat for {quiet:.0f} s: stopped or hung; last seen at {state}"
            if not arrived:
                missing.append(f"rank {rank} ({state})")
        if missing:
            return "not arrived: " + ", ".join(missing) if in_read else "not arrived: " + "; ".join(missing)
        if in_read:  # the transfer may still be running on the device: the read waits for it
            return f"every peer arrived (ranks {silent} send no heartbeat)" if silent else "every peer arrived"
        if silent:
            return f"every peer arrived, but ranks {silent} send no heartbeat (stopped or hung inside it)"
        if slow:
            return f"every peer arrived; ranks {slow} are slow, not dead (late heartbeats): the link is slow"
        return "every peer arrived and is alive: the transfer itself is stalled (network?)"
