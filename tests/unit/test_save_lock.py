"""One job per --save directory (megatron_moe/checkpointing/lock.py)."""

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_moe.checkpointing import lock as save_lock
from megatron_moe.checkpointing.lock import LOCK_FILE, Holder, SaveLock, SaveLockBusy
from megatron_moe.config import parse_args
from tests.conftest import ROOT, shell_env


def write_lock(root, holder: Holder, age_s: float = 0.0) -> str:
    path = os.path.join(root, LOCK_FILE)
    with open(path, "w") as out:
        json.dump(dataclasses.asdict(holder), out)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def other_job(**changes) -> Holder:
    me = Holder.this_process()
    job = dataclasses.replace(me, started="2026-11-25T10:00:00+00:00", command="pretrain_gpt_moe.py --other")
    return dataclasses.replace(job, **changes)


def test_taken_then_released_and_an_empty_new_directory_removed(tmp_path):
    root = tmp_path / "save"
    held = SaveLock.take(str(root))
    content = json.loads((root / LOCK_FILE).read_text())
    assert content["pid"] == os.getpid() and content["host"] == Holder.this_process().host
    assert content["command"] and "started" in content
    held.release()
    assert not root.exists()  # a run that wrote nothing leaves no directory behind
    (tmp_path / "kept").mkdir()
    SaveLock.take(str(tmp_path / "kept")).release()
    assert os.listdir(tmp_path / "kept") == []


def test_a_live_job_on_this_host_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    job = other_job()  # this very process: alive, same start time
    path = write_lock(tmp_path, job, age_s=5)
    with pytest.raises(SaveLockBusy) as refused:
        SaveLock.take(str(tmp_path))
    assert str(refused.value) == (
        f"--save={tmp_path}: another job is using this directory (host {job.host}, pid {os.getpid()}, "
        f"started 2026-11-25T10:00:00+00:00, slurm job 4242, command: pretrain_gpt_moe.py --other; lock {path}, "
        f"heartbeat 5 s ago); wait for that job to end or give another --save; if it is gone but its lock cannot "
        f"be judged from this host, delete {path} (or wait until its heartbeat is 600 s old)"
    )
    assert json.loads(open(path).read())["command"] == "pretrain_gpt_moe.py --other"  # left as it was


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"pid": "dead"}, "pid {pid} is not running on {host}"),
        ({"process_start": "1"}, "pid {pid} on {host} is now another process"),
        ({"boot_id": "another-boot"}, "its host has rebooted since"),
    ],
)
def test_a_dead_job_on_this_host_is_taken_over_with_a_warning(tmp_path, caplog, changes, reason):
    changes = {key: dead_pid() if value == "dead" else value for key, value in changes.items()}
    job = other_job(**changes)
    write_lock(tmp_path, job)
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        held = SaveLock.take(str(tmp_path))
    assert json.loads((tmp_path / LOCK_FILE).read_text())["command"] != job.command  # ours now
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"--save={tmp_path}: taking over a stale lock ({reason.format(**vars(job))}; host ")
    held.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_another_host_is_refused_while_its_heartbeat_is_fresh_and_taken_over_after(tmp_path, caplog):
    job = other_job(host="node-17", pid=12345)
    write_lock(tmp_path, job, age_s=save_lock.STALE_AFTER_S - 60)
    with pytest.raises(SaveLockBusy, match=r"another job is using this directory \(host node-17, pid 12345"):
        SaveLock.take(str(tmp_path))
    write_lock(tmp_path, job, age_s=save_lock.STALE_AFTER_S + 60)
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        SaveLock.take(str(tmp_path)).release()
    assert "taking over a stale lock (its heartbeat is 660 s old (stale after 600 s; another host" in caplog.text


def test_the_holder_keeps_its_heartbeat_fresh(tmp_path):
    held = SaveLock.take(str(tmp_path), heartbeat_s=0.05)
    path = tmp_path / LOCK_FILE
    os.utime(path, (1, 1))
    time.sleep(0.3)
    assert time.time() - path.stat().st_mtime < 5
    held.release()


def test_a_requeued_slurm_job_takes_over_its_earlier_run(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    write_lock(tmp_path, other_job(host="node-3", slurm_job_id="77", slurm_restart_count=None))  # fresh heartbeat
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        SaveLock.take(str(tmp_path)).release()
    assert "an earlier run of slurm job 77, requeued since" in caplog.text
    write_lock(tmp_path, other_job(host="node-3", slurm_job_id="77", slurm_restart_count="1"))  # a second step
    with pytest.raises(SaveLockBusy):
        SaveLock.take(str(tmp_path))


def small_cfg(save):
    return parse_args(["--data-path", "d", "--tokenizer-model", "t", "--save", str(save)])


def stub_startup(monkeypatch, train):
    import megatron_moe.training as training

    monkeypatch.setattr(training, "initialize", lambda cfg: None)
    monkeypatch.setattr(training, "start_watchdog", lambda cfg, end_job: None)
    monkeypatch.setattr(training, "shutdown", lambda destroy_process_group: None)
    monkeypatch.setattr(training, "_train", train)
    return training


def test_pretrain_holds_the_lock_and_releases_it_on_exit_and_on_error(tmp_path, monkeypatch):
    seen = []

    def train(cfg, watchdog, signals):
        seen.append((tmp_path / LOCK_FILE).exists())
        (tmp_path / "iter_0000001").mkdir(exist_ok=True)
        return []

    training = stub_startup(monkeypatch, train)
    training.pretrain(small_cfg(tmp_path))
    assert seen == [True] and not (tmp_path / LOCK_FILE).exists()

    def fail(cfg, watchdog, signals):
        raise RuntimeError("boom")

    stub_startup(monkeypatch, fail)
    with pytest.raises(RuntimeError, match="boom"):
        training.pretrain(small_cfg(tmp_path))
    assert not (tmp_path / LOCK_FILE).exists()


def test_pretrain_refuses_a_held_directory_before_the_model(tmp_path, monkeypatch):
    write_lock(tmp_path, other_job())
    training = stub_startup(monkeypatch, lambda cfg, watchdog: pytest.fail("built the model"))
    with pytest.raises(SaveLockBusy, match="another job is using this directory"):
        training.pretrain(small_cfg(tmp_path))
    assert (tmp_path / LOCK_FILE).exists()  # the other job's, untouched


def launch(data, tokenizer, save, *extra):
    env = shell_env(OMP_NUM_THREADS="1")
    flags = [
        "--num-experts", "4", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--data-path", data,
        "--tokenizer-model", tokenizer, "--save", str(save), "--load", str(save), "--no-save-optim", *extra,
    ]  # fmt: skip
    command = [sys.executable, os.path.join(ROOT, "pretrain_gpt_moe.py"), *flags]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def snapshot(root):
    return {
        os.path.relpath(os.path.join(folder, name), root): os.stat(os.path.join(folder, name)).st_mtime_ns
        for folder, _, names in os.walk(root)
        for name in names
        if name != LOCK_FILE
    }


def suspend_all(pid: int) -> None:
    """SIGSTOP to `pid` and every process under it, listed again until no new one appears: a save starts its
    writer processes (megatron-core's file writer forks them) while they are being listed, and one left running
    wrote into iter_N.tmp after the snapshot (once in CI)."""
    stopped: set[int] = set()
    while True:
        procs = []
        with contextlib.suppress(psutil.NoSuchProcess):
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        new = [proc for proc in procs if proc.pid not in stopped]
        if not new:
            return
        for proc in new:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.suspend()
            stopped.add(proc.pid)


def resume_all(pid: int) -> None:
    """SIGCONT to `pid` and every process under it, those still alive."""
    with contextlib.suppress(psutil.NoSuchProcess):
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.resume()


@pytest.mark.slow
def test_two_launches_on_one_directory_the_second_refused_the_first_intact(train_data, tmp_path):
    data, tokenizer = train_data
    save = tmp_path / "ckpt"
    first = launch(data, tokenizer, save, "--train-iters", "100000", "--save-interval", "2")
    try:
        deadline = time.time() + 240
        while not (save / "latest_checkpointed_iteration.txt").exists():
            assert first.poll() is None and time.time() < deadline, first.stderr.read()[-3000:]
            time.sleep(0.5)
        # Nothing of the first job runs meanwhile, its checkpoint writers included (a save in progress would add
        # files to its iter_N.tmp): its files stay as they are.
        suspend_all(first.pid)
        before = snapshot(save)
        second = launch(data, tokenizer, save, "--train-iters", "4", "--save-interval", "1")
        _, err = second.communicate(timeout=240)
        assert second.returncode == 2, err[-3000:]
        lines = [line for line in err.splitlines() if "error" in line.lower()]
        assert len(lines) == 1, err[-3000:]
        assert f"--save={save}: another job is using this directory (host " in lines[0]
        assert f"pid {first.pid}, started " in lines[0] and f"lock {save / LOCK_FILE}" in lines[0]
        assert "Traceback" not in err
        assert snapshot(save) == before  # the first job's checkpoints intact
    finally:
        resume_all(first.pid)
        first.send_signal(signal.SIGTERM)  # its preemption save, then a normal exit
        first.communicate(timeout=240)
    assert first.returncode == 0
    assert not (save / LOCK_FILE).exists()  # released on SIGTERM
