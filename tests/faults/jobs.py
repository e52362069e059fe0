"""The fault battery's harness: a real `pretrain_gpt_moe.py` job under torchrun (2 CPU ranks, a tiny MoE), its
output read as it comes, its processes found, signalled and, whatever happens, killed at the end.

Each job costs ~15 s to start here (torch and megatron-core imports on 2 cores), so the battery runs one
job per fault and chains them where one fault's end is the next one's start (tests/faults/test_saves.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time

import psutil

from tests.conftest import ROOT
from tests.distributed.launcher import tiny_pretrain_command

STEP = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: (\S+)")  # the short line (--log-format text)
RECORD = re.compile(r'\{"iteration": (\d+), "train_iters".*?"lm loss": ([^,}]+)')  # --log-format json: full precision


def step_match(line: str) -> re.Match | None:
    """A logged iteration's line: [1] its iteration, [2] its lm loss as printed."""
    return STEP.search(line) or RECORD.search(line)


RANK_ERROR = re.compile(r"\] rank (\d+): ")  # our error line: "[time] rank R: message"
POINTER = "latest_checkpointed_iteration.txt"


class Job:
    """One torchrun job, started in a session of its own; a thread collects its output lines."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            cwd=ROOT,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.times: list[float] = []  # time.monotonic() when each line was read
        self.ended_at: float | None = None
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._known: list[psutil.Process] = []  # every process of the job seen so far (for the final kill)

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line)
                self.times.append(time.monotonic())
                self._seen.notify_all()
        with self._seen:
            self.ended_at = time.monotonic()
            self._seen.notify_all()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def tail(self, chars: int = 4000) -> str:
        return self.text[-chars:]

    def wait_for(self, pattern: str | re.Pattern, timeout: float = 120) -> re.Match:
        """The first output line matching `pattern`, waiting for it; fails if the job ends or `timeout` passes."""
        pattern = re.compile(pattern)
        return self._wait(pattern.search, pattern.pattern, timeout)

    def first_at(self, pattern: str | re.Pattern) -> float | None:
        """When the first line matching `pattern` was read (time.monotonic()), or None."""
        pattern = re.compile(pattern)
        return next((t for line, t in zip(self.lines, self.times) if pattern.search(line)), None)

    def step(self, iteration: int, timeout: float = 120) -> re.Match:
        """Wait until the job has logged `iteration` or a later one; that line's `step_match`."""

        def reached(line: str) -> re.Match | None:
            m = step_match(line)
            return m if m and int(m[1]) >= iteration else None

        return self._wait(reached, f"iteration {iteration}", timeout)

    def _wait(self, match, what: str, timeout: float):
        end = time.monotonic() + timeout
        checked = 0
        with self._seen:
            while True:
                for line in self.lines[checked:]:
                    if found := match(line):
                        return found
                checked = len(self.lines)
                if self.ended_at is not None:
                    raise AssertionError(f"the job ended without printing {what!r}:\n{self.tail()}")
                if time.monotonic() > end:
                    raise AssertionError(f"no line {what!r} within {timeout:g} s:\n{self.tail()}")
                self._seen.wait(0.2)

    def finish(self, timeout: float = 120) -> int:
        """Wait for the job to end; its exit code."""
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=30)
        return self.proc.returncode

    def losses(self) -> dict[int, str]:
        """{iteration: its lm loss as printed}."""
        return {int(m[1]): m[2] for m in map(step_match, self.lines) if m}

    def processes(self) -> list[psutil.Process]:
        """The launcher and every live process under it (torchrun's workers and their checkpoint writers)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            launcher = psutil.Process(self.proc.pid)
            found = [launcher, *launcher.children(recursive=True)]
            self._known += [p for p in found if p not in self._known]
            return alive(found)
        return []

    def workers(self, timeout: float = 30) -> dict[int, psutil.Process]:
        """{rank: process} of the job's pretrain_gpt_moe.py workers (torchrun's children, not their writers)."""
        end = time.monotonic() + timeout
        while True:
            found = {}
            for proc in self.processes():
                with contextlib.suppress(psutil.NoSuchProcess):
                    if is_torchrun(proc.parent()) and "pretrain_gpt_moe.py" in " ".join(proc.cmdline()):
                        found[int(proc.environ()["RANK"])] = proc
            if len(found) == 2 or time.monotonic() > end:
                return found
            time.sleep(0.1)

    def signal_all(self, signum: int) -> None:
        """`signum` to every process of the job, as slurm's warning reaches every process of a job step."""
        for proc in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signum)

    def kill(self) -> None:
        """kill -9 of every process of the job (stopped ones resumed first, so that they can die)."""
        for proc in alive(self.processes() + self._known):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.resume()
                proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)


@contextlib.contextmanager
def job(cmd: list[str], env: dict | None = None):
    """A `Job` of `cmd`, every process of which is killed on the way out (a failed assertion too)."""
    started = Job(cmd, env)
    try:
        yield started
    finally:
        started.kill()


def tiny_job(train_data, *flags: str, env: dict | None = None):
    """`job` of the 2-rank tiny MoE (tests/distributed/launcher.py) with `flags`."""
    return job(tiny_pretrain_command(train_data, *flags), env)


def stop_rank_1_until_the_job_ends(run: Job, at_step: int = 3) -> float:
    """SIGSTOP rank 1 of `run` once it has logged `at_step`; SIGCONT it when rank 0 ends the job (a stopped
    process would hold torchrun's SIGTERM); wait for the end. Returns when rank 1 was stopped (time.monotonic())."""
    run.step(at_step)
    rank_1 = run.workers()[1]
    rank_1.suspend()
    stopped = time.monotonic()
    run.wait_for("ending the job", timeout=60)
    rank_1.resume()
    run.finish(timeout=60)
    return stopped


def is_torchrun(proc: psutil.Process | None) -> bool:
    return proc is not None and any(
        part in ("torch.distributed.run", "megatron_moe.launch") or part.endswith("/torchrun")
        for part in proc.cmdline()
    )


def alive(procs) -> list[psutil.Process]:
    live = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                live.append(proc)
    return live


def processes_with(marker: str) -> list[psutil.Process]:
    """Every live process whose command line contains `marker` (not zombies: they run nothing)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if marker in " ".join(proc.info["cmdline"] or ()) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def wait_gone(procs, seconds: float) -> list[psutil.Process]:
    """The processes of `procs` still alive after up to `seconds`."""
    end = time.monotonic() + seconds
    while (live := alive(procs)) and time.monotonic() < end:
        time.sleep(0.1)
    return live


def pointer(save: str) -> int:
    with open(os.path.join(save, POINTER)) as f:
        return int(f.read())


def rank_tracebacks(text: str) -> int:
    """How many Python tracebacks the ranks printed: torchrun's own (its SignalException, or the ChildFailedError
    that reports a failed rank, both from `python -m torch.distributed.run`, run by runpy) not counted."""
    chunks = text.split("Traceback (most recent call last):")[1:]
    return sum(not chunk.lstrip().startswith('File "<frozen runpy>"') for chunk in chunks)


def worker_failed(text: str, code: int) -> bool:
    """Whether torchrun's failure summary reports a rank that exited with `code` (torchrun itself exits 1)."""
    return re.search(rf"failed \(exitcode: {code}\) local_rank: \d", text) is not None


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if RANK_ERROR.search(line)]
