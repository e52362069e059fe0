"""The SIGTERM watcher's count: one stop that reaches the rank twice is one; a later one is a second."""

import os
import signal
import time

import pytest

from megatron_moe.training import preemption


@pytest.fixture
def watcher(monkeypatch):
    exits = []
    monkeypatch.setattr(preemption, "exit_now", exits.append)
    monkeypatch.setattr(preemption, "SAME_REQUEST_S", 0.5, raising=False)  # raising: absent before
    watching = preemption._SignalWatcher(rank=0)
    yield watching, exits
    watching.close()


def wait_for(condition, seconds=5.0):
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()


def test_a_sigterm_that_arrives_twice_at_once_is_one_and_a_later_one_is_a_second(watcher):
    watching, exits = watcher
    os.kill(os.getpid(), signal.SIGTERM)  # slurm's, to every process of the job
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's forward of its own
    assert wait_for(lambda: watching.signalled)
    time.sleep(0.2)
    assert exits == []
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)  # a person's second kill
    assert wait_for(lambda: exits == [128 + signal.SIGTERM])
