"""Saving: `save_checkpoint` writes `iter_N.tmp`, records the checksums, swaps it into place (an existing
`iter_N` moved aside first), publishes the pointer, and applies `--keep-last-n`; a full disk or any other failure
is one line with the partial copy removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from torch.distributed.checkpoint import CheckpointException

from megatron_moe import comm
from megatron_moe.checkpointing import integrity
from megatron_moe.checkpointing.paths import TRACKER, iter_dir, publish
from megatron_moe.checkpointing.state import OPTIMIZER_STATE_AT, TrainState, current_layout, sharded_state
from megatron_moe.config import RunConfig
from megatron_moe.failure import ONCE, forget_on_exit, undo_on_exit
from megatron_moe.platform import current_platform

log = logging.getLogger("megatron_moe")


# Test only (tests/faults/test_saves.py): "PHASE@ITERATION" makes the save of that iteration pause 3 s at
# PHASE ("begin": before anything is written; "publish": written, before rank 0 renames it into place), announced on
# stderr, so that a test can signal the job there. The writers' phase: upstream_fixes.WRITER_PAUSE_ENV.
SAVE_PAUSE_ENV = "MEGATRON_MOE_TEST_SAVE_PAUSE"


def save_checkpoint(
    root: str,
    cfg: RunConfig,
    model,
    optimizer,
    scheduler,
    train_state: TrainState,
    *,
    after_step: Callable[[str], None] | None = None,
    data: dict | None = None,
) -> str:
    """Collective: every rank calls it. Returns the published checkpoint directory. `data`: the run's
    `data_record` (data/fingerprint.py), which a resume checks (None: none recorded).

    `after_step(name)` runs on rank 0 after each step of publishing ("written",
    "old_moved", "new_in_place", "published"): tests inject a crash there.
    """
    final = iter_dir(root, train_state.iteration)
    tmp = final + ".tmp"
    drop_tmp = functools.partial(shutil.rmtree, tmp, ignore_errors=True)
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        _recover_swap(final)
        drop_tmp()  # a save that was killed earlier
        undo_on_exit(drop_tmp)  # the watchdog's exit and a second stop signal skip the handlers below
        os.makedirs(tmp)
    try:
        _save_and_publish(root, tmp, final, cfg, model, optimizer, scheduler, train_state, after_step, data)
    except KeyboardInterrupt:  # Ctrl-C is Python's only with --no-exit-signal-handler: the partial copy goes too
        if dist.get_rank() == 0:
            drop_tmp()
        raise
    finally:
        forget_on_exit(drop_tmp)
    return final


def _save_and_publish(root, tmp, final, cfg, model, optimizer, scheduler, train_state, after_step, data) -> None:
    comm.barrier("checkpoint_save_begin")
    _test_pause("begin", train_state.iteration)
    # Before the first step the optimizer holds no state (Adam's moments are lazy).
    with_optimizer = not cfg.checkpoint.no_save_optim and train_state.iteration > 0
    state = sharded_state(model, optimizer, with_optimizer=with_optimizer, with_rng=True, is_loading=False)
    state.update(
        train_state=dataclasses.asdict(train_state),
        scheduler=scheduler.state_dict(),
        config=cfg.to_dict(),
        layout=current_layout(),
        has_optimizer=with_optimizer,
        distributed_optimizer=cfg.sharded_by_ddp,
        optimizer_kind=cfg.optimizer_kind,  # Adam's and Muon's states differ (load.py `saved_optimizer_kind`)
        optimizer_state_at=OPTIMIZER_STATE_AT,  # saved after megatron-core's several-bucket fix
        vocab_size=getattr(model[0].module, "vocab_size", None),  # every chunk's: the padded vocabulary
        data=data,
    )
    with _disk_full_reported(root, tmp, lambda: _bytes_needed(root, state), every_rank=True):
        dist_checkpointing.save(state, tmp)
    comm.barrier("checkpoint_saved")
    _test_pause("publish", train_state.iteration)
    if dist.get_rank() == 0:
        with _disk_full_reported(root, tmp, lambda: _bytes_needed(root, state), every_rank=False):
            integrity.write_manifest(tmp)
        _swap_in(root, tmp, final, train_state.iteration, after_step or (lambda step: None))
        if cfg.checkpoint.keep_last_n is not None:
            _retain(root, cfg.checkpoint.keep_last_n, final)
        log.info("saved checkpoint at iteration %d to %s", train_state.iteration, final)
    comm.barrier("checkpoint_published")


def _test_pause(phase: str, iteration: int) -> None:
    if os.environ.get(SAVE_PAUSE_ENV) == f"{phase}@{iteration}":
        print(f"{SAVE_PAUSE_ENV}: rank {dist.get_rank()} pauses 3 s at {phase}", file=sys.stderr, flush=True)
        time.sleep(3)


def _swap_in(root: str, tmp: str, final: str, iteration: int, after_step: Callable[[str], None]) -> None:
    """Publish the complete copy `tmp` as `final`; a previous `final` stays (as `.old`) until the pointer moved.

    A crash between any two steps leaves a loadable checkpoint: the previous one
    (the pointer's `iter_N`, or `iter_N.old` while `iter_N` is missing) or the new one.
    """
    after_step("written")
    old = final + ".old"
    if os.path.isdir(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        after_step("old_moved")
    os.replace(tmp, final)
    after_step("new_in_place")
    publish(root, iteration)
    after_step("published")
    shutil.rmtree(old, ignore_errors=True)


def _retain(root: str, keep: int, published: str) -> None:
    """--keep-last-n: delete complete `iter_*` older than the newest `keep`, never `published` (the pointer's).

    A deleted directory is renamed away first, so a crash mid-delete leaves no half `iter_*` behind.
    """
    _, names = integrity.newest_complete(root)
    complete = [os.path.join(root, n) for n in names if integrity.is_complete(os.path.join(root, n))]
    for path in complete[:-keep]:
        if path != published:
            os.replace(path, path + ".deleting")
            shutil.rmtree(path + ".deleting")
            log.info("--keep-last-n=%d: deleted %s", keep, path)


def _recover_swap(final: str) -> None:
    """Undo a re-save killed between moving `final` aside and renaming the new copy into place."""
    old = final + ".old"
    if not os.path.isdir(final) and integrity.is_complete(old):
        os.replace(old, final)
        log.warning("restored %s from %s (a save of it was interrupted)", final, old, extra=ONCE)


@contextlib.contextmanager
def _disk_full_reported(root: str, tmp: str, needed: Callable[[], int], *, every_rank: bool):
    """Turn a save that failed for lack of space into one line naming --save, the bytes needed and free; any
    failure drops the partial `tmp`. `every_rank`: all ranks run this block (dist_checkpointing.save), so a
    failure that torch raises on every rank at once (its CheckpointException) is agreed on by all of them."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as error:  # torch's CheckpointException is a BaseException
        failure = _save_failure(root, tmp, error, needed, agree=every_rank and isinstance(error, CheckpointException))
        if failure is error:
            raise
        raise failure from error  # the one line is the failure's; MEGATRON_MOE_VERBOSE=1 shows the chain


def _save_failure(root: str, tmp: str, error: BaseException, estimate: Callable[[], int], *, agree: bool):
    """The error to raise for a save into `tmp` that raised `error`, once the partial `tmp` is removed.

    The writers' ENOSPC may reach this process only as text, or not at all (torch.save's "unexpected pos"), and a
    rank other than dist_checkpointing's coordinator gets no details: a failure with (almost) no space left where
    the checkpoint goes counts as a full disk too, and with `agree` the ranks agree on it and on the figures their
    line prints (one collective: torch raised the CheckpointException on every rank at the same point). Identical
    lines are printed once per host; figures measured by each rank at its own moment were not identical.
    """
    written = integrity.dir_bytes(tmp) if os.path.isdir(tmp) else 0
    needed = max(estimate(), written)
    full = integrity.is_disk_full(error) or integrity.free_bytes(root) < min(needed, integrity.NEARLY_FULL)
    shutil.rmtree(tmp, ignore_errors=True)
    free = integrity.free_bytes(root)  # a writer's file unlinked while still open frees its space late: agreed below
    if agree:
        table = torch.tensor([int(full), needed, free], dtype=torch.int64, device=current_platform().device)
        comm.agree_save_failure(table)
        with comm.host_read("save failure"):
            full, needed, free = table.tolist()
    if full:
        return integrity.disk_full_error(root, tmp, needed, free)
    if isinstance(error, CheckpointException):  # an Exception, so that the fail-fast handler reports it
        return RuntimeError(f"--save={root}: writing {os.path.basename(tmp)} failed: {integrity.describe(error)}")
    return error


def _bytes_needed(root: str, state: dict) -> int:
    """The previous checkpoint's size, or (first save) this rank's tensors times the world size."""
    pointer = os.path.join(root, TRACKER)
    if os.path.isfile(pointer) and (text := open(pointer).read().strip()).isdigit():
        previous = iter_dir(root, int(text))
        if os.path.isdir(previous):
            return integrity.dir_bytes(previous)
    tensors = [t.data for t in nested_values(state) if isinstance(t, ShardedTensor) and t.data is not None]
    return sum(t.numel() * t.element_size() for t in tensors) * dist.get_world_size()
