"""Where checkpoints are in a `--save` directory: the pointer (`TRACKER`, published last, atomically), the
`iter_N` directories, which one `--load` resumes from, and the start-up check that a `--save` directory is not
overwritten by accident.
"""

from __future__ import annotations

import logging
import os
import re

from megatron_moe.checkpointing import integrity
from megatron_moe.config import ConfigError, RunConfig
from megatron_moe.failure import ONCE
from megatron_moe.files import write_atomic

log = logging.getLogger("megatron_moe")


TRACKER = "latest_checkpointed_iteration.txt"


def iter_dir(root: str, iteration: int) -> str:
    """The directory of checkpoint `iteration` under `root`."""
    return os.path.join(root, f"iter_{iteration:07d}")


def saved_iteration(path: str | None) -> int | None:
    """The iteration of checkpoint directory `path` (iter_N, or iter_N.old), from its name; None for none."""
    match = re.search(r"iter_(\d+)(\.old)?$", os.path.normpath(path)) if path else None
    return int(match.group(1)) if match else None


def publish(root: str, iteration: int) -> None:
    """Point `root`'s tracker at `iteration` (atomically: tmp file + rename)."""
    write_atomic(os.path.join(root, TRACKER), str(iteration))


def latest_checkpoint(root: str) -> str | None:
    """The published checkpoint under `root`, or None if nothing was published there."""
    pointer = os.path.join(root, TRACKER)
    if not os.path.isfile(pointer):
        return None
    text = open(pointer).read().strip()
    if not text.isdigit():
        if os.path.isdir(os.path.join(root, text)):  # Megatron-LM's "release" (a converted model)
            check_not_legacy(root, os.path.join(root, text))
        raise ConfigError(f"--load={root}: {TRACKER} holds {text!r}, not an iteration number")
    path = iter_dir(root, int(text))
    if not os.path.isdir(path) and integrity.is_complete(path + ".old"):  # a re-save killed mid-swap
        log.warning("--load=%s: %s is missing, loading the previous copy %s.old", root, path, path, extra=ONCE)
        return path + ".old"
    if not os.path.isdir(path):
        raise ConfigError(f"--load={root}: {TRACKER} names iteration {text} but {path} is missing")
    return path


def resolve_load_dir(cfg: RunConfig) -> str | None:
    """The checkpoint to resume from, None to start fresh; a clear error for a bad --load."""
    path = _resolve_load_dir(cfg)
    if path is not None and not integrity.is_complete(path):
        check_not_legacy(cfg.checkpoint.load, path)
    return path


LEGACY_FILE = "model_optim_rng.pt"
"""Megatron-LM's torch-format checkpoint: iter_N/mp_rank_XX[_YYY]/model_optim_rng.pt (--ckpt-format torch)."""


def check_not_legacy(root: str, path: str) -> None:
    """Refuse an old-format Megatron-LM checkpoint, saying what it is and how to convert it."""
    ranks = sorted(name for name in os.listdir(path) if name.startswith("mp_rank_"))
    if any(os.path.isfile(os.path.join(path, name, LEGACY_FILE)) for name in ranks):
        raise ConfigError(
            f"--load={root}: {path} is an old-format Megatron-LM checkpoint (torch format: {ranks[0]}/{LEGACY_FILE}), "
            f"not a distributed one; convert it once with Megatron-LM (its training script with --load {root} "
            f"--ckpt-convert-format torch_dist --ckpt-convert-save NEW_DIR) and give NEW_DIR as --load"
        )


def _resolve_load_dir(cfg: RunConfig) -> str | None:
    root = cfg.checkpoint.load
    if root is None:
        return None
    resuming_own_saves = root == cfg.checkpoint.save  # auto-resume pattern (e.g. a requeued job)
    if not os.path.isdir(root):
        if resuming_own_saves:
            return None
        raise ConfigError(f"--load={root}: no such directory; give a directory written by --save")
    if os.path.isfile(os.path.join(root, "metadata.json")):  # one checkpoint, e.g. --load SAVE/iter_0000100
        return root
    path = latest_checkpoint(root)
    if path is not None:
        return path
    # No pointer: never start from scratch over iterations saved there (a later save would overwrite them).
    newest, found = integrity.newest_complete(root)
    if newest is not None:
        log.warning(
            "--load=%s: no %s there; loading the newest complete checkpoint %s", root, TRACKER, newest, extra=ONCE
        )
        return newest
    if found:
        check_not_legacy(root, os.path.join(root, found[-1]))
        raise ConfigError(
            f"--load={root}: no {TRACKER} there and none of its {len(found)} iter_* directories ({found[-1]}, ...) "
            f"is complete (no metadata.json); remove them or give another --save/--load directory"
        )
    if resuming_own_saves:  # nothing saved yet
        return None
    raise ConfigError(f"--load={root}: no {TRACKER} there; give a directory written by --save")


def check_save_dir(cfg: RunConfig) -> None:
    """Refuse a --save directory holding complete checkpoints that this run does not resume from: starting from
    scratch there would overwrite them (a re-run of a job that forgot --load). Filesystem only: before the model.
    A --load of one of its own iterations (rolling back, e.g. before a loss spike) is a deliberate choice."""
    root, load = cfg.checkpoint.save, cfg.checkpoint.load
    if root is None or not os.path.isdir(root):
        return
    if load is not None and os.path.realpath(root) in (os.path.realpath(load), os.path.dirname(os.path.realpath(load))):
        return
    newest, _ = integrity.newest_complete(root)
    if newest is None:
        return
    given = f"--load={load}" if load else "no --load"
    raise ConfigError(
        f"--save={root}: it holds saved checkpoints (newest complete: {os.path.basename(newest)}) and this run has "
        f"{given}, so its saves would overwrite them; pass --load {root} to resume from them, or give an empty or "
        f"new --save directory"
    )
