"""Ctrl-C is a stop request like SIGTERM, and the ways out that skip `finally` leave no lock or partial save.

The torchrun jobs (Ctrl-C during training, at the start of a save, while the writers write) are in
tests/faults/test_interrupts.py.

Before: SIGINT raised KeyboardInterrupt in the main thread wherever it was: inside logging's at-fork hook while
the checkpoint writers were forked it was "ignored" (`Exception ignored in _releaseLock`) and training went on;
elsewhere 150-300 lines of tracebacks. The watchdog's end of the job (and a second stop signal) left the save
lock and `iter_N.tmp` behind.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_moe import failure
from megatron_moe.training import preemption
from tests.conftest import ROOT


def wait_for(condition, seconds=5.0):
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()


@pytest.fixture
def exits(monkeypatch):
    """exit_now as a list of the codes it was called with (the process stays)."""
    called = []
    monkeypatch.setattr(preemption, "exit_now", called.append)
    monkeypatch.setattr(preemption, "SAME_REQUEST_S", 0.5)
    return called


def test_sigint_is_a_stop_request_that_raises_nothing_and_a_later_one_exits(exits):
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler; SIG_IGN in a shell's background job
    watcher = preemption._SignalWatcher(rank=0)
    try:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(50):  # the main thread runs Python code meanwhile: nothing is raised into it
                time.sleep(0.01)
        except KeyboardInterrupt:  # before: here, or wherever the main thread was (a fork's hook: lost)
            pytest.fail("SIGINT raised KeyboardInterrupt")
        assert wait_for(lambda: watcher.signalled)
        assert watcher.signum == signal.SIGINT and exits == []
        time.sleep(0.6)  # past SAME_REQUEST_S: a second request
        os.kill(os.getpid(), signal.SIGINT)
        assert wait_for(lambda: exits == [128 + signal.SIGINT])
    finally:
        watcher.close()
    assert signal.getsignal(signal.SIGINT) is before


def test_stop_signals_name_the_first_signal_and_restore_the_handlers(exits):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)  # as the process inherited them
    with preemption.StopSignals(enabled=True, rank=0) as signals:
        assert signals.received == 0
        os.kill(os.getpid(), signal.SIGINT)
        assert wait_for(lambda: signals.received == signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)  # the same stop by another route: still SIGINT's
        time.sleep(0.1)
        assert signals.received == signal.SIGINT and exits == []
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    with preemption.StopSignals(enabled=False) as disabled:  # --no-exit-signal-handler: the handlers untouched
        assert disabled.received == 0 and signal.getsignal(signal.SIGINT) is before[0]


class Exited(BaseException):
    """What os._exit does to the caller: nothing after it runs (`finally` blocks aside, here)."""


@pytest.fixture
def exit_now_without_exiting(monkeypatch):
    def _exit(code):
        raise Exited(code)

    monkeypatch.setattr(failure, "_end_process", _exit)
    monkeypatch.setattr(failure.logging, "shutdown", lambda: None)


def test_the_watchdogs_exit_releases_the_save_lock(tmp_path):
    """`exit_now` is how the watchdog ends the job (`training.end_job_with_report`) and how a second stop signal
    does (`preemption._SignalWatcher`); here in a process of its own, for real."""
    code = (
        "import sys; from megatron_moe.checkpointing.lock import SaveLock; from megatron_moe.failure import exit_now; "
        "lock = SaveLock.take(sys.argv[1]); print('held', flush=True); exit_now(1)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
        text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1:] == ["held"], (proc.stdout, proc.stderr[-3000:])
    assert os.listdir(tmp_path) == []  # before: the lock, left for the next job to judge stale


def test_the_watchdog_ends_the_job_through_exit_now(monkeypatch):
    import megatron_moe.training as training

    ended = []
    monkeypatch.setattr(training, "exit_now", ended.append)
    training.end_job_with_report("rank 0: blocked 9 s in collective ...")
    assert ended == [1]


def test_an_exit_during_a_save_removes_its_partial_copy(megatron_world1, tmp_path, exit_now_without_exiting):
    from tests.unit.test_checkpoint_safety import Run

    run = Run(tmp_path)
    run.save(2)
    seen = []

    def watchdog_fires(step):
        if step == "written":  # everything written, not yet renamed into place
            seen.append(sorted(os.listdir(tmp_path)))
            failure.exit_now(1)

    with pytest.raises(Exited):
        run.save(4, after_step=watchdog_fires)
    assert seen == [["iter_0000002", "iter_0000004.tmp", "latest_checkpointed_iteration.txt"]]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    with pytest.raises(Exited):
        failure.exit_now(1)  # the save is over: nothing of it is registered any more
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
