"""Checkpoints that cannot be lost: no pointer, re-saves killed mid-swap, checksums, shapes, a full disk."""

import errno
import os
import re
import shutil
import subprocess
import traceback

import pytest
import torch

from megatron_moe.checkpointing import (
    TRACKER,
    TrainState,
    check_save_dir,
    integrity,
    load_checkpoint,
    resolve_load_dir,
    save_checkpoint,
)
from megatron_moe.checkpointing.integrity import MANIFEST, CheckpointError
from megatron_moe.config import ConfigError, parse_args

SMALL = "--num-layers 1 --hidden-size 64 --num-attention-heads 4 --num-experts 4 --seq-length 32".split()
BATCH = "--micro-batch-size 2 --global-batch-size 2 --train-iters 2 --no-save-optim".split()


def cfg(*flags):
    return parse_args(["--data-path", "d", "--tokenizer-model", "t", *flags])


def fake_iteration(root, iteration, *, complete=True, suffix=""):
    path = root / f"iter_{iteration:07d}{suffix}"
    path.mkdir()
    if complete:
        (path / "metadata.json").write_text("{}")
    return path


def test_missing_pointer_loads_the_newest_complete_iteration(tmp_path, caplog):
    fake_iteration(tmp_path, 10)
    fake_iteration(tmp_path, 20)
    fake_iteration(tmp_path, 30, complete=False)  # killed before dist_checkpointing finished
    fake_iteration(tmp_path, 40, suffix=".tmp")
    for flags in (("--load", str(tmp_path), "--save", str(tmp_path)), ("--load", str(tmp_path))):
        with caplog.at_level("WARNING", logger="megatron_moe"):
            assert resolve_load_dir(cfg(*flags)) == str(tmp_path / "iter_0000020")
        assert f"no {TRACKER} there; loading the newest complete checkpoint" in caplog.text


def test_missing_pointer_and_no_complete_iteration_is_refused(tmp_path):
    fake_iteration(tmp_path, 30, complete=False)
    with pytest.raises(ConfigError, match=rf"--load={tmp_path}: no {TRACKER} there and none of its 1 iter_\*"):
        resolve_load_dir(cfg("--load", str(tmp_path), "--save", str(tmp_path)))


def test_only_an_unfinished_first_save_starts_fresh(tmp_path):
    fake_iteration(tmp_path, 5, suffix=".tmp")  # nothing was ever published there
    assert resolve_load_dir(cfg("--load", str(tmp_path), "--save", str(tmp_path))) is None


def test_save_onto_saved_checkpoints_without_resuming_from_them_is_refused(tmp_path, monkeypatch):
    fake_iteration(tmp_path, 10)
    fake_iteration(tmp_path, 20)
    fake_iteration(tmp_path, 30, complete=False)
    save = str(tmp_path)
    other = tmp_path.parent / "elsewhere"
    for flags, given in ((("--save", save), "no --load"), (("--save", save, "--load", str(other)), f"--load={other}")):
        with pytest.raises(ConfigError) as refused:
            check_save_dir(cfg(*flags))
        assert str(refused.value) == (
            f"--save={save}: it holds saved checkpoints (newest complete: iter_0000020) and this run has {given}, "
            f"so its saves would overwrite them; pass --load {save} to resume from them, or give an empty or new "
            f"--save directory"
        )
    # Resuming (also from one of its own iterations), an empty or new directory, or only unfinished saves: allowed.
    check_save_dir(cfg("--save", save, "--load", save))
    check_save_dir(cfg("--save", save, "--load", str(tmp_path / "iter_0000010")))
    check_save_dir(cfg("--save", str(other)))
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    fake_iteration(unfinished, 5, complete=False)
    fake_iteration(unfinished, 6, suffix=".tmp")
    check_save_dir(cfg("--save", str(unfinished)))
    # pretrain() refuses before any process group (or model) is set up.
    import megatron_moe.training as training

    calls = []
    monkeypatch.setattr(training, "initialize", lambda cfg: calls.append("initialize"))
    with pytest.raises(ConfigError, match=rf"--save={save}: it holds saved checkpoints"):
        training.pretrain(cfg("--save", save))
    assert calls == []


class Run:
    """A one-layer MoE model saved and loaded in this process (a world of one)."""

    def __init__(self, root, vocab=128, flags=()):
        from megatron_moe.model import transformer_config
        from megatron_moe.training.setup import build_ddp_model, build_optimizer, build_scheduler

        self.root = str(root)
        self.cfg = cfg(*SMALL, *BATCH, "--save", self.root, "--load", self.root, *flags)
        self.cfg.validate(world_size=1)
        self.model = build_ddp_model(self.cfg, transformer_config(self.cfg), vocab)
        self.optimizer = build_optimizer(self.cfg, self.model)
        self.scheduler = build_scheduler(self.cfg, self.optimizer)

    def weights(self):
        return [p.detach().clone() for p in self.model[0].module.parameters()]

    def set_weights(self, offset):
        with torch.no_grad():
            for p in self.model[0].module.parameters():
                p.fill_(offset)

    def save(self, iteration, **kwargs):
        args = (self.cfg, self.model, self.optimizer, self.scheduler, TrainState(iteration=iteration))
        return save_checkpoint(self.root, *args, **kwargs)

    def load(self, path=None):
        path = path or resolve_load_dir(self.cfg)
        return load_checkpoint(path, self.cfg, self.model, self.optimizer, self.scheduler)


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Crash(Exception):
    pass


def crash_after(name):
    def after_step(step):
        if step == name:
            raise Crash(step)

    return after_step


@pytest.mark.parametrize(
    "step, survivor", [("written", "old"), ("old_moved", "old"), ("new_in_place", "new"), ("published", "new")]
)
def test_resave_killed_at_each_step_leaves_a_loadable_copy(megatron_world1, tmp_path, step, survivor):
    run = Run(tmp_path)
    run.set_weights(1.0)
    run.save(5)
    old = run.weights()
    run.set_weights(2.0)
    new = run.weights()
    with pytest.raises(Crash):
        run.save(5, after_step=crash_after(step))
    run.set_weights(0.0)
    assert run.load().iteration == 5
    assert same(run.weights(), old if survivor == "old" else new)
    # The next save (e.g. the requeued job's) recovers and publishes a complete copy, leaving no .old/.tmp.
    run.set_weights(3.0)
    third = run.weights()
    run.save(5)
    run.set_weights(0.0)
    run.load()
    assert same(run.weights(), third)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000005", TRACKER]


def test_checksums_name_the_damaged_file(megatron_world1, tmp_path):
    run = Run(tmp_path / "ckpt")
    saved = run.save(1)
    names = os.listdir(saved)
    assert MANIFEST in names and "common.pt" in names and ".metadata" in names
    shard = sorted(n for n in names if n.endswith(".distcp"))[0]

    def damaged(name, damage):
        path = str(tmp_path / f"damaged_{name.strip('.')}_{damage.__name__}")
        shutil.copytree(saved, path)
        damage(os.path.join(path, name))
        return path

    def flip(file):
        data = bytearray(open(file, "rb").read())
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 64])
        open(file, "wb").write(bytes(data))

    def truncate(file):
        os.truncate(file, os.path.getsize(file) // 2)

    cases = [(shard, flip, "is corrupt"), (shard, truncate, r"were saved \(truncated\?\)")]
    cases += [(name, os.remove, "is missing") for name in (shard, "common.pt", ".metadata")]
    for name, damage, what in cases:
        path = damaged(name, damage)
        with pytest.raises(CheckpointError, match=rf"^--load={re.escape(path)}: {re.escape(name)} .*{what}") as error:
            run.load(path)
        assert "\n" not in str(error.value)
    run.load(saved)  # the original still loads


def test_another_vocabulary_is_refused_before_any_tensor_loads(megatron_world1, tmp_path, monkeypatch):
    saved = Run(tmp_path, vocab=128).save(1)
    bigger = Run(tmp_path, vocab=256)
    before = bigger.weights()
    with pytest.raises(ConfigError, match=r"padded vocabulary size is 128, this run's is 256"):
        bigger.load(saved)
    # A checkpoint that does not record its vocabulary size (saved before it did): the tensors' shapes tell.
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(saved)
    monkeypatch.setattr(dist_checkpointing, "load_common_state_dict", lambda path: {**common, "vocab_size": None})
    shapes = r"embedding\.word_embeddings\.weight: checkpoint \[128, 64\], now \[256, 64\]"
    with pytest.raises(CheckpointError, match=shapes):
        bigger.load(saved)
    assert same(bigger.weights(), before)


def test_full_disk_is_one_line_and_keeps_the_previous_checkpoint(megatron_world1, tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    run = Run(tmp_path)
    run.set_weights(1.0)
    previous = run.save(1)
    kept = run.weights()
    size = sum(os.path.getsize(os.path.join(previous, n)) for n in os.listdir(previous))

    def full_disk(state, path):
        open(os.path.join(path, "__0_0.distcp"), "wb").write(b"\0" * 100)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as error:
            raise RuntimeError("a writer failed") from error  # as dist_checkpointing wraps its writers' errors

    monkeypatch.setattr(dist_checkpointing, "save", full_disk)
    expected = rf"^--save={tmp_path}: disk full while writing iter_0000002\.tmp: about {size} bytes needed, \d+ free; "
    with pytest.raises(CheckpointError, match=expected + "the previous checkpoint is intact") as error:
        run.save(2)
    assert "\n" not in str(error.value)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", TRACKER]
    monkeypatch.undo()
    run.set_weights(0.0)
    assert run.load().iteration == 1
    assert same(run.weights(), kept)


def test_keep_last_n_never_deletes_the_published_checkpoint(megatron_world1, tmp_path):
    run = Run(tmp_path, flags=("--keep-last-n", "2"))
    for iteration in (1, 2, 3, 4):
        run.save(iteration)
    fake_iteration(tmp_path, 0, complete=False)  # not a complete checkpoint: not --keep-last-n's to delete
    assert sorted(os.listdir(tmp_path)) == ["iter_0000000", "iter_0000003", "iter_0000004", TRACKER]
    run.set_weights(1.0)
    run.save(1)  # e.g. re-running an old job: the pointer now names iteration 1, older than the newest two
    assert sorted(os.listdir(tmp_path)) == ["iter_0000000", "iter_0000001", "iter_0000003", "iter_0000004", TRACKER]
    assert run.load().iteration == 1
    run.save(5)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000000", "iter_0000004", "iter_0000005", TRACKER]
    with pytest.raises(ConfigError, match=r"--keep-last-n=0: must be > 0"):  # refused with the flags, before a save
        Run(tmp_path / "zero", flags=("--keep-last-n", "0"))


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB tmpfs: room for one checkpoint of `Run` (0.7 MB), not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_full_tmpfs_is_one_line_and_keeps_the_previous_checkpoint(megatron_world1, small_disk):
    run = Run(small_disk)
    run.set_weights(1.0)
    previous = run.save(1)
    kept = run.weights()
    run.set_weights(2.0)
    # The writer processes fail with ENOSPC; torch wraps it in a CheckpointException (a BaseException).
    line = rf"^--save={small_disk}: disk full while writing iter_0000002\.tmp: about (\d+) bytes needed, (\d+) free; "
    with pytest.raises(CheckpointError, match=line + "the previous checkpoint is intact") as error:
        run.save(2)
    assert "\n" not in str(error.value)
    needed, free = map(int, re.match(line, str(error.value)).groups())
    assert needed >= integrity.dir_bytes(previous) > free
    assert sorted(os.listdir(small_disk)) == ["iter_0000001", TRACKER]  # the partial iter_0000002.tmp is gone
    run.set_weights(0.0)
    assert run.load().iteration == 1
    assert same(run.weights(), kept)


def checkpoint_exception(failures):
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("write", failures)


def worker_failure(text):
    """What dist_checkpointing's coordinator gathers from a rank whose writer process failed: the writer's error
    pickled into its message, its cause lost on the way."""
    return (RuntimeError(f"Worker failure: {text}"), traceback.StackSummary())


@pytest.mark.parametrize(
    "failures, disk_full",
    [
        ({1: worker_failure("[Errno 28] No space left on device")}, True),
        ({0: worker_failure("Permission denied")}, False),
        ({}, False),  # a rank other than the coordinator: no details (the others agree on what rank 0 found)
    ],
)
def test_checkpoint_exception_is_one_line_and_drops_the_partial_copy(
    megatron_world1, tmp_path, monkeypatch, failures, disk_full
):
    from megatron.core import dist_checkpointing

    run = Run(tmp_path)
    run.save(1)

    def failing(state, path):
        open(os.path.join(path, "__0_0.distcp"), "wb").write(b"\0" * 100)
        raise checkpoint_exception(failures)  # a BaseException: no `except Exception` sees it

    monkeypatch.setattr(dist_checkpointing, "save", failing)
    expected = (CheckpointError, r"disk full while writing iter_0000002\.tmp") if disk_full else (RuntimeError, "")
    with pytest.raises(expected[0], match=rf"^--save={tmp_path}: {expected[1]}") as error:
        run.save(2)
    assert "\n" not in str(error.value)
    if not disk_full:
        assert str(error.value).startswith(f"--save={tmp_path}: writing iter_0000002.tmp failed: ")
        assert ("rank 0: RuntimeError: Worker failure: Permission denied" if failures else "on another rank") in str(
            error.value
        )
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", TRACKER]


def test_every_rank_prints_the_same_full_disk_line(megatron_world1, tmp_path, monkeypatch):
    """A full disk fails the save on every rank; each measures what is free at its own moment (a writer's file,
    unlinked while still open, frees its space late). The line is printed once per host only when it is the same
    on every rank, so its figures are the agreed ones: here a peer found more bytes free than this rank."""
    from megatron.core import dist_checkpointing

    from megatron_moe import comm

    run = Run(tmp_path)
    run.save(1)

    def failing(state, path):
        raise checkpoint_exception({1: worker_failure("[Errno 28] No space left on device")})

    def with_a_peer(table):  # the max over this rank and a peer that saw 1 MB more free
        peer = table.clone()
        peer[-1] += 2**20
        return table.copy_(torch.maximum(table, peer))

    monkeypatch.setattr(dist_checkpointing, "save", failing)
    monkeypatch.setattr(comm, "agree_save_failure", with_a_peer)
    monkeypatch.setattr(integrity, "free_bytes", lambda root: 5000)
    with pytest.raises(CheckpointError, match=rf"bytes needed, {5000 + 2**20} free; the previous checkpoint is intact"):
        run.save(2)
