"""Test modules' torchrun parts run together: one job per world size for every module this pytest session runs.

A module declares its parts (`JOB_PARTS = {name: Part(...)}`) and asks `shared_jobs.result(name)` for one; the
first request of a world size runs every part of that size that the session's selected tests declare, in one job
(`job_runner.py`), so selecting one module runs only its parts. A part that fails fails its own module's tests:
the job stops at it, its error is that job's output, and the parts after it run in a new job. A session `start`s
the jobs in the background at its first test (niced: they take the cores its other tests leave idle) and runs the
modules that read them last (`conftest.py`); a `timed` part runs in the foreground when first asked for, and a
`quiet_cores` test runs with the background paused (`paused`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from tests.distributed.launcher import BACKGROUND, ROOT, descendants, free_port, left_behind

RUNNER = os.path.join(ROOT, "tests", "distributed", "job_runner.py")
_STARTED: list[SharedJobs] = []
"""Every `SharedJobs` started in this process (`paused` stops their jobs)."""
_JOB_NUMBERS = itertools.count(1)
"""The session's background jobs, numbered across instances: each job's mark its own."""
TIMING = re.compile(r"\[job\] (\S+): ([0-9.]+) s, (\d+) threads after$", re.M)
"""job_runner.py's line after each part (rank 0's stderr)."""


@dataclasses.dataclass(frozen=True)
class Part:
    """`WORKER.ENTRY()` on `nproc` ranks, sys.argv[1:] = `args` with {data}, {tokenizer}, {workdir} and
    {tokenizer_runs} filled in (the session's corpus, tokenizer, this part's directory, `tokenizer_train_data`'s
    JSON)."""

    worker: str
    entry: str
    nproc: int
    args: tuple[str, ...] = ()
    workdir: str | None = None
    """Parts naming the same workdir share one directory (one saves a checkpoint that another loads)."""
    after: tuple[str, ...] = ()
    """Parts (in smaller jobs) that must have run first: this one reads what they wrote."""
    timeout: int = 300
    timed: bool = False
    """Its results are timings a test bounds: it runs in a job of its own in the foreground when first asked for,
    never niced in the background (there its timed sections took the cores only when the foreground left them:
    the cost profile's model error read 280%)."""


class PartFailed(AssertionError):
    pass


class SharedJobs:
    """`parts` by name; `values` fills their arguments' fields; `mktemp(key)` makes a directory."""

    def __init__(self, parts: dict[str, Part], values: dict[str, str], mktemp):
        self.parts, self.values, self.mktemp = parts, values, mktemp
        self.outcomes: dict[str, dict | str] = {}
        self.workdirs: dict[str, str] = {}
        self.timings: dict[str, tuple[float, int]] = {}
        """{part: (seconds, rank 0's threads after it)} of the parts that finished: the session's summary."""
        self.niceness = 0
        self._background: threading.Thread | None = None
        self._changed = threading.Condition()
        self._job_proc: subprocess.Popen | None = None
        self.running_job: str | None = None
        """The mark (`launcher.BACKGROUND`) of the background job in flight."""
        self._stopped = False
        self._paused = False

    def start(self, niceness: int = 19) -> None:
        """Run every part's job now, in a background thread, its ranks at `niceness`: they take the cores the
        session's other tests leave idle (sleeping in a fault test, one process of a unit test, a launch's
        imports) and yield them when those tests want them. `result` waits for its part."""
        if self._background is not None or not self.parts:
            return
        for name in self.parts:
            self.workdir(name)  # here, not in the background thread: the directories are made on this one
        self.niceness = niceness
        _STARTED.append(self)
        self._background = threading.Thread(target=self._run_all, name="shared-jobs", daemon=True)
        self._background.start()

    def stop(self) -> None:
        """End the background's job, if one is running (a session that ends early leaves no job behind)."""
        with self._changed:  # no job starts after this (`_job` starts one under this lock)
            self._stopped, proc = True, self._job_proc
            self._changed.notify_all()
        if proc is not None and proc.poll() is None:
            kill_tree(proc.pid)
        if self._background is not None:
            self._background.join()

    def pause(self, paused: bool) -> None:
        """SIGSTOP (True) or SIGCONT (False) the background's job in flight; while paused it starts none."""
        with self._changed:
            self._paused, proc = paused, self._job_proc
            self._changed.notify_all()
        if proc is not None and proc.poll() is None:
            signal_tree(proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def _run_all(self) -> None:
        for nproc in sorted({part.nproc for part in self.parts.values()}, reverse=True):
            self._run(nproc, timed=False)

    def workdir(self, name: str) -> str:
        """Part `name`'s directory (its `workdir` key's, made on first use)."""
        key = self.parts[name].workdir or name
        if key not in self.workdirs:
            self.workdirs[key] = self.mktemp(key)
        return self.workdirs[key]

    def result(self, name: str) -> dict:
        """Part `name`'s {case: result}, its job run on first request; raises PartFailed with its job's output."""
        if not self.parts[name].timed:
            with self._changed:
                self._changed.wait_for(lambda: name in self.outcomes or not self._background_alive())
        if name not in self.outcomes:  # timed, not started, or the background thread ended early (an error of its own)
            self._run(self.parts[name].nproc, self.parts[name].timed)
        outcome = self.outcomes[name]
        if isinstance(outcome, str):
            raise PartFailed(outcome)
        return outcome

    def _run(self, nproc: int, timed: bool) -> None:
        pending = [name for name, part in self.parts.items()
                   if part.nproc == nproc and part.timed == timed and name not in self.outcomes]  # fmt: skip
        for name in pending:
            for before in self.parts[name].after:
                if before not in self.outcomes:
                    self._run(self.parts[before].nproc, self.parts[before].timed)
        while pending and not self._stopped:
            done, output = self._job(nproc, pending)
            if output and all(name in done for name in pending):  # failed after its parts (its teardown)
                done = dict.fromkeys(pending, output)
            pending = [name for name in pending if name not in done]
            if pending:  # the job stopped at its first pending part
                done[pending.pop(0)] = output or "the job ended without a result for it"
            with self._changed:
                self.outcomes.update(done)
                self._changed.notify_all()

    def _background_alive(self) -> bool:
        return self._background is not None and self._background.is_alive()

    def _job(self, nproc: int, names: list[str]) -> tuple[dict, str]:
        """One torchrun job of `names`: the results of those that finished, and the job's output if it failed."""
        spec = [
            {"name": name, "worker": self.parts[name].worker, "entry": self.parts[name].entry,
             "args": [arg.format(**self.values, workdir=self.workdir(name)) for arg in self.parts[name].args]}
            for name in names
        ]  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            results, spec_path = os.path.join(tmp, "results.json"), os.path.join(tmp, "spec.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            python_path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RESULTS": results, "PYTHONPATH": python_path,
                   "MEGATRON_MOE_FORCE_CPU": "1"}  # fmt: skip
            job = None
            if threading.current_thread() is self._background:  # marked: no foreground launch counts it as its own
                job = env[BACKGROUND] = f"{os.getpid()}.{next(_JOB_NUMBERS)}"
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   f"--master-port={free_port()}", RUNNER, spec_path]  # fmt: skip
            if job:
                cmd = ["nice", "-n", str(self.niceness), *cmd]
            before = descendants(job)
            timeout = sum(self.parts[name].timeout for name in names) * (3 if job and self.niceness else 1)
            with self._changed:
                if job:  # a paused background starts no job
                    self._changed.wait_for(lambda: not self._paused or self._stopped)
                if self._stopped:
                    return {}, f"stopped before its job started; parts {names}"
                proc = subprocess.Popen(
                    cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    start_new_session=True,
                )  # fmt: skip
                self._job_proc, self.running_job = proc, job
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
                failure = f"{' '.join(cmd)} failed ({proc.returncode})" if proc.returncode else ""
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                stdout, stderr = proc.communicate()
                failure = f"{' '.join(cmd)} ran past {timeout} s"
            self.timings.update({name: (float(secs), int(threads)) for name, secs, threads in TIMING.findall(stderr)})
            leftovers = left_behind(before, job)
            done = {}
            if os.path.exists(results):
                with open(results) as f:
                    done = json.load(f)
        if not failure and leftovers:
            failure = f"processes outlived the job: {leftovers}"
            done = {}
        return done, f"{failure}; parts {names}:\n{stdout[-6000:]}\n{stderr[-6000:]}" if failure else ""


@contextlib.contextmanager
def paused():
    """The background's jobs stopped for the block (a `quiet_cores` test: its wall-clock bounds are milliseconds,
    and a niced job still takes a core for a scheduler slice now and then: a clock-offset miss of 9 ms, bound 5)."""
    for jobs in _STARTED:
        jobs.pause(True)
    try:
        yield
    finally:
        for jobs in _STARTED:
            jobs.pause(False)


def signal_tree(pid: int, signum: int) -> None:
    """Send `signum` to process `pid` and its descendants (torchrun starts each rank in a session of its own): the
    root first, so it starts no other rank meanwhile. SIGSTOP returns once each has stopped (a process running on
    another core stops a moment after), or after 2 s."""
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signum)
        deadline = time.monotonic() + 2.0
        while signum == signal.SIGSTOP and time.monotonic() < deadline and not all(map(_stopped, procs)):
            time.sleep(0.01)


def _stopped(proc: psutil.Process) -> bool:
    try:
        return proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return True


def kill_tree(pid: int) -> None:
    """SIGKILL process `pid` and its descendants."""
    signal_tree(pid, signal.SIGKILL)


def train_part(scenario: str, nproc: int = 4, **fields) -> Part:
    """train_worker.py's `scenario` on the session's corpus and tokenizer."""
    return Part("train_worker", scenario, nproc, (scenario, "{data}", "{tokenizer}", "{workdir}"), **fields)
