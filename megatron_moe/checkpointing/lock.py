"""One job per `--save` directory: a lock file, held by the job's rank 0 while it runs.

`SaveLock.take(root)` creates `root/megatron_moe.lock` (JSON: host, pid, the process's start, the command line,
the slurm job) or refuses, naming the job that holds it and the lock file. The holder refreshes the file's mtime
every `HEARTBEAT_S` seconds (a thread) and removes it on release (normal exit, an error, a stop signal's save,
the watchdog's exit, a second stop signal). A lock left by a killed job is stale and taken over with a warning
line: holder on this host not running (or another process, or the host rebooted), an earlier run of this slurm
job (a requeue), or a holder on another host whose heartbeat is older than `STALE_AFTER_S`.
Assumed of the filesystem: `os.link` onto an existing name fails atomically for every client, `os.rename` is
atomic, mtimes propagate within seconds, clocks agree well within `STALE_AFTER_S`. The rules in full and why
fcntl is not used: docs/internals/checkpointing.md.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass

from megatron_moe.config import ConfigError
from megatron_moe.failure import forget_on_exit, undo_on_exit

log = logging.getLogger("megatron_moe")

LOCK_FILE = "megatron_moe.lock"
HEARTBEAT_S = 30.0
"""How often the holder refreshes the lock file's mtime."""
STALE_AFTER_S = 600.0
"""A lock from another host whose mtime is older than this is taken to be from a dead job."""


class SaveLockBusy(ConfigError):
    """Another live job holds the `--save` directory."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: what the lock file says."""

    host: str
    pid: int
    process_start: str | None  # /proc/PID/stat's start time (clock ticks since boot); None where there is no /proc
    boot_id: str | None
    started: str  # UTC, ISO 8601
    command: str
    slurm_job_id: str | None
    slurm_restart_count: str | None

    @classmethod
    def this_process(cls) -> Holder:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            process_start=process_start(os.getpid()),
            boot_id=boot_id(),
            started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=shlex.join(sys.argv),
            slurm_job_id=os.environ.get("SLURM_JOB_ID"),
            slurm_restart_count=os.environ.get("SLURM_RESTART_COUNT"),
        )

    def describe(self) -> str:
        job = f", slurm job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"host {self.host}, pid {self.pid}, started {self.started}{job}, command: {self.command}"


def process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (None: no /proc, or no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]  # field 22; the name before ")" may hold spaces
    except (OSError, IndexError):
        return None


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return boot.read().strip()
    except OSError:
        return None


def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def stale_reason(holder: Holder, age_s: float, stale_after_s: float) -> str | None:
    """Why `holder`'s lock (last refreshed `age_s` seconds ago) is from a dead job; None: it may be alive."""
    me = Holder.this_process()
    if me.slurm_job_id and holder.slurm_job_id == me.slurm_job_id:
        if holder.slurm_restart_count != me.slurm_restart_count:
            return f"an earlier run of slurm job {me.slurm_job_id}, requeued since"
    if holder.host == me.host:
        if holder.boot_id and me.boot_id and holder.boot_id != me.boot_id:
            return "its host has rebooted since"
        if not pid_running(holder.pid):
            return f"pid {holder.pid} is not running on {holder.host}"
        now = process_start(holder.pid)
        if holder.process_start and now and now != holder.process_start:
            return f"pid {holder.pid} on {holder.host} is now another process"
        return None
    if age_s > stale_after_s:
        return f"its heartbeat is {age_s:.0f} s old (stale after {stale_after_s:.0f} s; another host: pid not checked)"
    return None


class SaveLock:
    """The lock on one `--save` directory, held by this process until `release()`."""

    def __init__(self, path: str, holder: Holder, heartbeat_s: float, created_dir: bool = False):
        self.path = path
        self.holder = holder
        self.created_dir = created_dir  # removed again on release if still empty: a refused run leaves nothing
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(heartbeat_s,), name="save-lock-heartbeat")
        self._thread.daemon = True
        self._thread.start()
        undo_on_exit(self.release)  # the watchdog's exit and a second stop signal skip `finally` blocks

    @classmethod
    def take(cls, root: str, *, stale_after_s: float = STALE_AFTER_S, heartbeat_s: float = HEARTBEAT_S) -> SaveLock:
        """Take the lock on `root` (created if missing), taking a stale one over with a warning line; raise
        `SaveLockBusy` naming the holder when another live job holds it."""
        created_dir = not os.path.isdir(root)
        os.makedirs(root, exist_ok=True)
        path = os.path.join(root, LOCK_FILE)
        me = Holder.this_process()
        for _ in range(3):  # a lost race for a stale lock: judge the winner's
            if _create(path, me):
                return cls(path, me, heartbeat_s, created_dir)
            found = _read(path)
            if found is None:  # released (or taken over) meanwhile
                continue
            holder, age_s = found
            reason = stale_reason(holder, age_s, stale_after_s) if holder else None
            if holder is None and age_s > stale_after_s:
                reason = f"unreadable and {age_s:.0f} s old"
            if reason is None:
                raise SaveLockBusy(refusal(root, path, holder, age_s, stale_after_s))
            if _remove_if_unchanged(path, holder):
                who = holder.describe() if holder else "unknown holder"
                log.warning("--save=%s: taking over a stale lock (%s; %s): %s", root, reason, who, path)
        raise SaveLockBusy(f"--save={root}: could not take the lock {path} (other jobs keep taking it); retry")

    def _beat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file, if it is still this process's."""
        forget_on_exit(self.release)
        self._stop.set()
        found = _read(self.path)
        if found is not None and found[0] == self.holder:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        if self.created_dir:
            with contextlib.suppress(OSError):  # not empty: this run wrote checkpoints there
                os.rmdir(os.path.dirname(self.path))


def refusal(root: str, path: str, holder: Holder | None, age_s: float, stale_after_s: float) -> str:
    who = holder.describe() if holder else "its content is unreadable"
    return (
        f"--save={root}: another job is using this directory ({who}; lock {path}, heartbeat {age_s:.0f} s ago); "
        f"wait for that job to end or give another --save; if it is gone but its lock cannot be judged from "
        f"this host, delete {path} (or wait until its heartbeat is {stale_after_s:.0f} s old)"
    )


def _create(path: str, holder: Holder) -> bool:
    """Atomically create the lock with `holder`'s content (write a unique file, then link it): False if it exists."""
    unique = f"{path}.{holder.host}.{holder.pid}.{threading.get_ident()}"
    with open(unique, "w") as out:
        json.dump(asdict(holder), out)
        out.flush()
        os.fsync(out.fileno())
    try:
        os.link(unique, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # NFS: a retransmitted link may fail although it took; the link count tells
        return os.stat(unique).st_nlink == 2
    finally:
        os.remove(unique)


def _read(path: str) -> tuple[Holder | None, float] | None:
    """(the holder, seconds since its last heartbeat); None if there is no lock; holder None if unreadable."""
    try:
        age_s = time.time() - os.stat(path).st_mtime
        with open(path) as lock:
            text = lock.read()
    except FileNotFoundError:
        return None
    try:
        return Holder(**json.loads(text)), age_s
    except (ValueError, TypeError):
        return None, age_s


def _remove_if_unchanged(path: str, holder: Holder | None) -> bool:
    """Remove the stale lock judged above; if another job took it over meanwhile, leave theirs (False).

    The lock is renamed away first (atomic: of two jobs taking over, one rename finds nothing); if what was
    renamed is not the lock judged stale, it is linked back, never over a newer one.
    """
    aside = f"{path}.stale.{socket.gethostname()}.{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    moved = _read(aside)
    if moved is not None and moved[0] != holder and holder is not None:
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        os.remove(aside)
        return False
    os.remove(aside)
    return True
