"""Faults around checkpoints, on real 2-rank jobs: preemption in each phase of a save, resume exactness, a
second job on the same --save directory, kill -9 in a save, a full disk, a corrupt shard and index.

The save faults run as one chain on one --save directory, each job resuming where the last one stopped
(a job costs ~15 s to start here):

    uninterrupted:  iterations 1-12, no checkpoint: the losses every resume must reproduce
    P1  SIGTERM to every process while the ranks begin the save at 2  -> the save completes; the ranks exit 0
    P2  SIGTERM to every process while the writers write the save at 4 -> likewise
    P3  SIGTERM to every process while the save at 6 is published     -> likewise
    P4  writers paused in the save at 8; a second job on the directory is refused; then kill -9 of P4
    P5  takes P4's stale lock over, resumes from 6 and trains to 12

The SIGTERM reaches torchrun too (slurm signals every process of a job step): torchrun forwards it to the
ranks, gives them 30 s (torch's fixed grace) to exit, and then exits 1 itself (its own SignalException),
whatever the ranks did; the ranks' part is what is checked here.

Before: P1-P3 took the one SIGTERM for a second one in 3 of 4 tries (exit without saving, iter_N.tmp
left); the second job was not refused and wrote over the first's checkpoints; a full disk printed 140 lines
and kept the partial iter_N.tmp.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from megatron_moe.checkpointing import SAVE_PAUSE_ENV
from megatron_moe.checkpointing.lock import LOCK_FILE
from megatron_moe.platform.upstream_fixes import WRITER_PAUSE_ENV
from tests.distributed.launcher import tiny_pretrain_command
from tests.faults.jobs import POINTER, Job, error_lines, job, pointer, rank_tracebacks, tiny_job, worker_failed

ITERS = 12
FLAGS = ("--train-iters", str(ITERS), "--lr", "1e-3", "--hidden-dropout", "0.1", "--save-interval", "2")
LOSSES = ("--log-format", "json")  # the losses at full precision: a resume continues them exactly
PHASES = {  # job: (how its save is paused, the line that says it is, the iteration of that save)
    "P1": ({SAVE_PAUSE_ENV: "begin@2"}, rf"{SAVE_PAUSE_ENV}: rank \d pauses", 2),
    "P2": ({WRITER_PAUSE_ENV: "3"}, rf"{WRITER_PAUSE_ENV}: writer \d+ pauses", 4),
    "P3": ({SAVE_PAUSE_ENV: "publish@6"}, rf"{SAVE_PAUSE_ENV}: rank \d pauses", 6),
}
PHASE_NAMES = {"P1": "begin", "P2": "writers", "P3": "publish"}


def saved_names(save: str) -> list[str]:
    return sorted(os.listdir(save))


def iteration_dirs(*iterations: int) -> list[str]:
    return [f"iter_{i:07d}" for i in iterations]


@pytest.fixture(scope="module")
def chain(train_data, tmp_path_factory):
    """Runs the chain; {name: (ended Job, what was observed)}."""
    save = str(tmp_path_factory.mktemp("chain") / "ckpt")
    flags = (*FLAGS, *LOSSES, "--save", save, "--load", save)
    runs: dict[str, tuple[Job, dict]] = {"save": save}

    with tiny_job(train_data, *FLAGS[:6], *LOSSES) as uninterrupted:  # alongside P1: its start-up overlaps P1's pauses
        run_chain(train_data, save, flags, runs)
        uninterrupted.finish(timeout=300)
    runs["uninterrupted"] = (uninterrupted, {})
    return runs


def run_chain(train_data, save: str, flags: tuple, runs: dict) -> None:
    for name, (env, paused, _) in PHASES.items():
        with tiny_job(train_data, *flags, env=env) as job:
            job.wait_for(paused)
            time.sleep(0.5)  # every rank (and writer) is in that phase now
            job.signal_all(signal.SIGTERM)
            job.finish(timeout=120)
            seen = {"names": saved_names(save), "pointer": pointer(save)}
        runs[name] = (job, seen)

    with tiny_job(train_data, *flags, env={WRITER_PAUSE_ENV: "120"}) as p4:
        p4.wait_for(rf"{WRITER_PAUSE_ENV}: writer \d+ pauses")
        holder = p4.workers()[0].pid
        before = {name: os.stat(os.path.join(save, name)).st_mtime_ns for name in os.listdir(save)}
        with tiny_job(train_data, *flags) as second:
            second_code = second.finish(timeout=120)
        after = {name: os.stat(os.path.join(save, name)).st_mtime_ns for name in os.listdir(save)}
        p4.kill()
        runs["second"] = (second, {"code": second_code, "holder": holder, "untouched": before == after})
        runs["P4"] = (p4, {"names": saved_names(save), "pointer": pointer(save)})

    with tiny_job(train_data, *flags) as p5:
        p5.finish(timeout=300)
        runs["P5"] = (p5, {"names": saved_names(save)})


@pytest.mark.parametrize("name", list(PHASES), ids=list(PHASE_NAMES.values()))
def test_one_sigterm_in_a_phase_of_a_save_completes_it_then_saves_and_exits_0(chain, name):
    job, seen = chain[name]
    saved_at = PHASES[name][2]
    assert "second SIGTERM" not in job.text, job.tail()
    assert f"SIGTERM received: iteration {saved_at} is saved; exiting" in job.text, job.tail()
    assert re.search(r"Process \d+ got signal: 15", job.text), job.tail()  # torchrun's own exit (1)
    assert rank_tracebacks(job.text) == 0, job.tail()
    finished = [PHASES[p][2] for p in PHASES if p <= name]
    assert seen["names"] == [*iteration_dirs(*finished), POINTER], seen  # no iter_N.tmp, no lock left
    assert seen["pointer"] == saved_at


def test_each_resume_continues_the_uninterrupted_run_exactly(chain):
    straight = chain["uninterrupted"][0].losses()
    assert sorted(straight) == list(range(1, ITERS + 1)), chain["uninterrupted"][0].tail()
    first = {"P1": 1, "P2": 3, "P3": 5, "P4": 7, "P5": 7}
    for name, start in first.items():
        losses = chain[name][0].losses()
        assert min(losses) == start, (name, losses)
        assert losses == {i: straight[i] for i in losses}, (name, losses, straight)
    assert max(chain["P5"][0].losses()) == ITERS


def test_a_second_job_on_the_save_directory_is_refused_naming_the_first(chain):
    second, seen = chain["second"]
    assert seen["code"] != 0 and worker_failed(second.text, 2), second.tail()  # exit 2 for a refusal
    refusals = [line for line in error_lines(second.text) if "another job is using this directory" in line]
    assert refusals, second.tail()
    assert f"--save={chain['save']}: another job is using this directory (host " in refusals[0]
    assert f", pid {seen['holder']}, started " in refusals[0], refusals[0]
    assert rank_tracebacks(second.text) == 0 and not second.losses(), second.tail()
    assert seen["untouched"], "the refused job changed the first job's directory"


def test_kill_9_in_a_save_keeps_the_previous_checkpoint_and_its_lock_is_taken_over(chain):
    _, killed = chain["P4"]
    assert killed["pointer"] == 6
    assert LOCK_FILE in killed["names"], killed  # kill -9 cannot release it
    p5, seen = chain["P5"]
    assert p5.proc.returncode == 0, p5.tail()
    assert re.search(rf"--save={re.escape(chain['save'])}: taking over a stale lock \(pid \d+ is not running", p5.text)
    assert re.search(r"loaded \S+/iter_0000006 \(iteration 6, optimizer restored\)", p5.text), p5.tail()
    assert seen["names"] == [*iteration_dirs(2, 4, 6, 8, 10, 12), POINTER], seen


@pytest.fixture
def small_disk(tmp_path, chain):
    """A real tmpfs with room for one checkpoint of the tiny job (as saved by the chain), not two."""
    one = sum(entry.stat().st_size for entry in os.scandir(os.path.join(chain["save"], "iter_0000012")))
    disk = tmp_path / "disk"
    disk.mkdir()
    size_kib = int(1.5 * one / 1024)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(disk)]
    mounted = subprocess.run(mount, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.decode().strip()}")
    yield str(disk)
    subprocess.run(["umount", str(disk)], check=True)


ITERATION_LINE = re.compile(r"\] iteration +\d+/")
TORCHRUN_LINE = re.compile(r"[WEI]\d{4} ")  # torchrun's logging prefix, e.g. "W1126 04:42:57.196000 ..."


def test_a_full_disk_is_one_line_and_leaves_the_previous_checkpoint_alone(train_data, small_disk):
    with tiny_job(train_data, *FLAGS, "--save", small_disk) as job:
        code = job.finish(timeout=300)
    assert code != 0, job.tail()
    lines = [line for line in error_lines(job.text) if "disk full" in line]
    assert lines, job.tail()
    line = rf"--save={re.escape(small_disk)}: disk full while writing iter_0000004\.tmp: about \d+ bytes needed"
    assert re.search(line, lines[0]), lines[0]
    assert "the previous checkpoint is intact" in lines[0], lines[0]
    assert rank_tracebacks(job.text) == 0, job.tail()
    # What the ranks printed after their last iteration line (torchrun's own report not counted) was 80 lines with
    # five tracebacks; now it is the one error line and torch's checkpoint writers' one-line notes ("Local process N
    # encountered an error"), as many as there are writers.
    last = max(i for i, text in enumerate(job.lines) if ITERATION_LINE.search(text))
    after = [text for text in job.lines[last + 1 :] if not TORCHRUN_LINE.match(text)]
    after = after[: next((i for i, text in enumerate(after) if text.startswith("Traceback")), len(after))]
    unexpected = [text for text in after if "disk full" not in text and "Local process" not in text]
    assert len(lines) == 1 and unexpected == [], after
    assert saved_names(small_disk) == [*iteration_dirs(2), POINTER]  # the partial .tmp is gone, the lock too


DAMAGED = {"shard": "__0_0.distcp", "index": ".metadata"}


@pytest.fixture(scope="module")
def corrupt_loads(train_data, chain, tmp_path_factory):
    """Jobs loading copies of the chain's last checkpoint, one with a byte of a shard flipped, one with a byte of
    its index (.metadata) flipped, run at once: {case: (ended Job, the iteration directory)}."""
    loads = {}
    for case, damaged in DAMAGED.items():
        load = str(tmp_path_factory.mktemp(case) / "ckpt")
        shutil.copytree(os.path.join(chain["save"], "iter_0000012"), os.path.join(load, "iter_0000012"))
        with open(os.path.join(load, POINTER), "w") as f:
            f.write("12")
        path = os.path.join(load, "iter_0000012", damaged)
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(path, "wb").write(bytes(data))
        loads[case] = load
    with one_rank_job(train_data, loads["shard"]) as shard, one_rank_job(train_data, loads["index"]) as index:
        shard.finish(timeout=300)
        index.finish(timeout=300)
    return {"shard": (shard, loads["shard"]), "index": (index, loads["index"])}


def one_rank_job(train_data, load: str):
    """A 1-rank job (half a 2-rank job's start-up) loading `load`: the checks before any tensor is read are the
    same on every rank, in any layout."""
    cmd = tiny_pretrain_command(train_data, "--train-iters", str(ITERS + 2), "--load", load)
    cmd[cmd.index("--nproc-per-node=2")] = "--nproc-per-node=1"
    cmd[cmd.index("--expert-model-parallel-size") + 1] = "1"
    return job(cmd)


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_corrupt_shard_or_index_is_named_before_training(corrupt_loads, case):
    job, load = corrupt_loads[case]
    assert job.proc.returncode != 0 and worker_failed(job.text, 2), job.tail()
    where = f"--load={os.path.join(load, 'iter_0000012')}: {DAMAGED[case]} "
    named = [line for line in error_lines(job.text) if where in line]
    assert named and "is corrupt" in named[0], job.tail()
    assert rank_tracebacks(job.text) == 0 and not job.losses(), job.tail()
