"""Process lifetimes, single machine: the parent-death signal, SIGTERM counting, the checkpoint-writer patch.

The torchrun jobs (killed launchers, SIGTERMs to workers, a rank killed mid-save) are in
tests/faults/test_ranks.py.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from megatron_moe.lifetime import die_with_parent
from megatron_moe.training.preemption import SAME_REQUEST_S
from tests.conftest import ROOT

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def python(code: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, **kwargs
    )


@linux_only
def test_a_child_that_asked_dies_with_its_parent_and_one_that_did_not_survives():
    # The parent starts two children (one calls die_with_parent()), prints their pids, then waits to be killed.
    parent = python("""
        import subprocess, sys, time
        code = ("import time; from megatron_moe.lifetime import die_with_parent; {}; "
                "print('up', flush=True); time.sleep(60)")
        kids = [subprocess.Popen([sys.executable, "-c", code.format(call)], stdout=subprocess.PIPE, text=True)
                for call in ("die_with_parent()", "None")]
        for kid in kids:
            kid.stdout.readline()
        print(*(kid.pid for kid in kids), flush=True)
        time.sleep(60)
    """)
    bound, free = (psutil.Process(int(pid)) for pid in parent.stdout.readline().split())
    try:
        parent.kill()
        parent.wait()
        bound.wait(timeout=10)  # psutil.TimeoutExpired if it outlived its parent
        time.sleep(0.5)
        assert free.is_running() and free.status() != psutil.STATUS_ZOMBIE  # no signal without asking
    finally:
        free.kill()


@linux_only
def test_a_parent_that_ended_before_the_call_ends_the_child_at_once():
    # What a child sees when its parent died between its start and its die_with_parent(): another parent.
    child = python("from megatron_moe.lifetime import die_with_parent; die_with_parent(1 << 22); print('survived')")
    assert child.communicate(timeout=30)[0] == ""
    assert child.returncode == 128 + signal.SIGKILL


def test_die_with_parent_is_a_no_op_off_linux(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert die_with_parent(os.getppid()) is False


WATCHER = """
    import os, signal, sys, time
    import logging
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    from megatron_moe.training.preemption import _SignalWatcher
    watcher = _SignalWatcher(rank=3)
    {body}
"""


def run_watcher(body: str, *signals: int) -> tuple[int, list[str]]:
    """Run `body` under a _SignalWatcher in a fresh process, sending it `signals` once it printed "ready"."""
    proc = python(
        WATCHER.format(body=textwrap.indent(textwrap.dedent(body), " " * 4).strip()), stderr=subprocess.STDOUT
    )
    lines = [proc.stdout.readline()]
    while lines[-1] not in ("ready\n", ""):  # megatron-core may print a notice first
        lines.append(proc.stdout.readline())
    assert lines[-1] == "ready\n", lines
    lines = lines[-1:]
    for signum in signals:
        os.kill(proc.pid, signum)
        # The process acts on each before the next (a loaded machine included); sooner than SAME_REQUEST_S, the next
        # would be the same stop again (tests/unit/test_preemption.py).
        time.sleep(SAME_REQUEST_S + 1.0)
    out = proc.communicate(timeout=30)[0]
    return proc.returncode, lines + out.splitlines()


@pytest.mark.slow  # each case starts a fresh interpreter that imports megatron-core: ~5 s
def test_the_first_sigterm_is_a_request_and_the_second_exits_at_once():
    body = """
        print("ready", flush=True)
        while not watcher.signalled:
            time.sleep(0.01)
        print("first SIGTERM seen", flush=True)
        time.sleep(20)  # the second SIGTERM ends the process during this wait
        print("not reached", flush=True)
    """
    code, lines = run_watcher(body, signal.SIGTERM, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, lines
    assert lines[1:] == ["first SIGTERM seen", "rank 3: second SIGTERM: exiting without saving"], lines


@pytest.mark.slow
def test_a_forked_childs_sigterms_are_not_counted_as_the_parents():
    body = """
        print("ready", flush=True)
        child = os.fork()
        if child == 0:  # a data-loader worker, say: it shares the watcher's pipe
            time.sleep(20)
            os._exit(0)
        time.sleep(0.5)
        os.kill(child, signal.SIGTERM)
        time.sleep(0.3)
        os.kill(child, signal.SIGTERM)
        time.sleep(0.5)
        print("parent signalled:", watcher.signalled, flush=True)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    """
    code, lines = run_watcher(body)
    assert code == 0, lines
    assert lines[1:] == ["parent signalled: False"], lines


@pytest.mark.slow
def test_sigint_is_a_stop_request_like_sigterm():
    """Before: SIGINT raised KeyboardInterrupt unless a SIGTERM came first (lost inside a fork's hook)."""
    body = """
        try:
            print("ready", flush=True)
            time.sleep(2)
        except KeyboardInterrupt:
            print("KeyboardInterrupt", flush=True)
        print("watcher signalled:", watcher.signalled, watcher.signum == signal.SIGINT, flush=True)
        watcher.close()
        print("handlers restored:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
    """
    code, lines = run_watcher(body, signal.SIGINT)
    assert code == 0, lines
    assert lines[1:] == ["watcher signalled: True True", "handlers restored: True"], lines
    code, lines = run_watcher("print('ready', flush=True); time.sleep(20)", signal.SIGTERM, signal.SIGINT)
    assert code == 128 + signal.SIGINT, lines
    assert lines[1:] == ["rank 3: second SIGINT: exiting without saving"], lines


def test_checkpoint_writer_patch_is_applied():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_moe.platform import init_platform

    init_platform()
    queue = filesystem_async._get_write_results_queue
    assert queue.__code__.co_filename.endswith(os.path.join("platform", "upstream_fixes.py"))
    write = filesystem_async.FileSystemWriterAsync.write_preloaded_data
    assert write.__code__.co_filename.endswith(os.path.join("platform", "upstream_fixes.py"))
