"""Save and resume with megatron-core dist_checkpointing.

Layout of a `--save` directory:

    latest_checkpointed_iteration.txt   "N", written last (tmp file + rename)
    iter_000000N/                       one dist_checkpointing checkpoint
    iter_000000N.tmp/                   a save in progress (never read)
    iter_000000N.old/                   the previous copy of N while a re-save of N is swapped in

A save writes into `iter_N.tmp`, records every file's sha256 in its
`checksums.json` once every rank has finished, renames it to `iter_N` (an
existing `iter_N` is moved to `iter_N.old` first and deleted only after the
pointer moved), then publishes the pointer: a save killed at any point leaves a
loadable checkpoint that the pointer finds. Without a pointer, `--load` takes the
newest complete `iter_*` (never starts from scratch over them). Loading verifies
the checksums and compares the model's shapes and vocabulary before any tensor. Sharded tensors are resharded by
dist_checkpointing on load, so a checkpoint loads into any TP/PP/EP/ESP layout, with or without virtual
pipeline stages (each chunk's state under "model0", "model1", ... as Megatron-LM stores them; the keys number the
layers globally).
Each rank's RNG states are restored when the layout is the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import shutil
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from torch.distributed.checkpoint import CheckpointException

from megatron_moe import comm
from megatron_moe.checkpointing import integrity
from megatron_moe.config import ConfigError, RunConfig
from megatron_moe.failure import ONCE
from megatron_moe.files import write_atomic
from megatron_moe.platform import current_platform
from megatron_moe.platform.rng import get_rng_states, set_rng_states

log = logging.getLogger("megatron_moe")

TRACKER = "latest_checkpointed_iteration.txt"
# "fully_reshardable": the distributed optimizer gathers its state into model-parameter
# space on save, so it loads into any TP/PP/EP/DP layout (0.16.1 cannot save the
# "fully_sharded_model_space" format: flattened ranges are no longer supported).
# No "chained_N." key prefix: with EP>1 megatron chains a dense and an expert
# optimizer, and the keys must not depend on that for a checkpoint to move layouts.
# Test only (tests/faults/test_saves.py): "PHASE@ITERATION" makes the save of that iteration pause 3 s at
# PHASE ("begin": before anything is written; "publish": written, before rank 0 renames it into place), announced on
# stderr, so that a test can signal the job there. The writers' phase: upstream_fixes.WRITER_PAUSE_ENV.
SAVE_PAUSE_ENV = "MEGATRON_MOE_TEST_SAVE_PAUSE"
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
# Flags whose change makes a checkpoint's weights meaningless for this model.
SHAPE_FIELDS = {
    "model": (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "position_embedding_type",
        "normalization",
        "swiglu",
        "disable_bias_linear",
        "untie_embeddings_and_output_weights",
    ),
    "moe": ("num_experts", "moe_layer_freq", "moe_ffn_hidden_size"),
}


@dataclasses.dataclass
class TrainState:
    """Where training stands: restored exactly on resume."""

    iteration: int = 0
    consumed_train_samples: int = 0


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _layout() -> dict[str, int]:
    return {
        "world": dist.get_world_size(),
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "vpp": parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
        "ep": parallel_state.get_expert_model_parallel_world_size(),
        "esp": parallel_state.get_expert_tensor_parallel_world_size(),
    }


def _rng_state() -> dict:
    """Python's, numpy's and torch's RNG states, the device's too (its generator and the tracker's streams)."""
    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "device_type": current_platform().device.type,
        **get_rng_states(),
    }


def _set_rng_state(state: dict) -> bool:
    """Restore `state`; False (nothing restored) when it was saved on another kind of device."""
    saved_on = state.get("device_type", "cpu")  # checkpoints from before GPU runs: CPU, "torch" for "cpu"
    if saved_on != current_platform().device.type:
        return False
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    set_rng_states(
        {
            "cpu": state.get("cpu", state.get("torch")),
            "tracker": state["tracker"],
            **({"device": state["device"]} if "device" in state else {}),
        }
    )
    return True


def model_state_keys(model) -> list[str]:
    """Where each model chunk's state sits in a checkpoint's state dict, as Megatron-LM stores it: "model" for one
    chunk, "model0", "model1", ... for the chunks of an interleaved pipeline. Only the nesting differs: the sharded
    tensors' own keys number the layers globally (megatron-core's offset per rank and virtual stage), so a
    checkpoint loads into any PP and virtual-pipeline layout, optimizer state included."""
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def _sharded_state(model, optimizer, *, with_optimizer: bool, with_rng: bool, is_loading: bool) -> dict:
    state = {key: chunk.module.sharded_state_dict() for key, chunk in zip(model_state_keys(model), model)}
    if with_optimizer:
        # The optimizer's keys come from the parameters' sharded tensors, found in every chunk's state.
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata=OPTIMIZER_SHARDING
        )
    if with_rng:
        rank, world = dist.get_rank(), dist.get_world_size()
        state["rng_state"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return state


def save_checkpoint(
    root: str,
    cfg: RunConfig,
    model,
    optimizer,
    scheduler,
    train_state: TrainState,
    *,
    after_step: Callable[[str], None] | None = None,
) -> str:
    """Collective: every rank calls it. Returns the published checkpoint directory.

    `after_step(name)` runs on rank 0 after each step of publishing ("written",
    "old_moved", "new_in_place", "published"): tests inject a crash there.
    """
    final = _iter_dir(root, train_state.iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        _recover_swap(final)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that was killed earlier
        os.makedirs(tmp)
    comm.barrier("checkpoint_save_begin")
    _test_pause("begin", train_state.iteration)
    # Before the first step the optimizer holds no state (Adam's moments are lazy).
    with_optimizer = not cfg.checkpoint.no_save_optim and train_state.iteration > 0
    state = _sharded_state(model, optimizer, with_optimizer=with_optimizer, with_rng=True, is_loading=False)
    state.update(
        train_state=dataclasses.asdict(train_state),
        scheduler=scheduler.state_dict(),
        config=cfg.to_dict(),
        layout=_layout(),
        has_optimizer=with_optimizer,
        distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        vocab_size=getattr(model[0].module, "vocab_size", None),  # every chunk's: the padded vocabulary
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
    return final


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
    _publish(root, iteration)
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
    the checkpoint goes counts as a full disk too, and with `agree` the ranks agree on it (one collective: torch
    raised the CheckpointException on every rank at the same point).
    """
    written = integrity.dir_bytes(tmp) if os.path.isdir(tmp) else 0
    needed = max(estimate(), written)
    full = integrity.is_disk_full(error) or integrity.free_bytes(root) < min(needed, integrity.NEARLY_FULL)
    shutil.rmtree(tmp, ignore_errors=True)
    if agree:
        table = torch.tensor([int(full), needed], dtype=torch.int64, device=current_platform().device)
        comm.agree_save_failure(table)
        with comm.host_read("save failure"):
            full, needed = table.tolist()
    if full:
        return integrity.disk_full_error(root, tmp, needed)
    if isinstance(error, CheckpointException):  # an Exception, so that the fail-fast handler reports it
        return RuntimeError(f"--save={root}: writing {os.path.basename(tmp)} failed: {integrity.describe(error)}")
    return error


def _bytes_needed(root: str, state: dict) -> int:
    """The previous checkpoint's size, or (first save) this rank's tensors times the world size."""
    pointer = os.path.join(root, TRACKER)
    if os.path.isfile(pointer) and (text := open(pointer).read().strip()).isdigit():
        previous = _iter_dir(root, int(text))
        if os.path.isdir(previous):
            return integrity.dir_bytes(previous)
    tensors = [t.data for t in nested_values(state) if isinstance(t, ShardedTensor) and t.data is not None]
    return sum(t.numel() * t.element_size() for t in tensors) * dist.get_world_size()


def _publish(root: str, iteration: int) -> None:
    write_atomic(os.path.join(root, TRACKER), str(iteration))


def latest_checkpoint(root: str) -> str | None:
    """The published checkpoint under `root`, or None if nothing was published there."""
    pointer = os.path.join(root, TRACKER)
    if not os.path.isfile(pointer):
        return None
    text = open(pointer).read().strip()
    if not text.isdigit():
        raise ConfigError(f"--load={root}: {TRACKER} holds {text!r}, not an iteration number")
    path = _iter_dir(root, int(text))
    if not os.path.isdir(path) and integrity.is_complete(path + ".old"):  # a re-save killed mid-swap
        log.warning("--load=%s: %s is missing, loading the previous copy %s.old", root, path, path, extra=ONCE)
        return path + ".old"
    if not os.path.isdir(path):
        raise ConfigError(f"--load={root}: {TRACKER} names iteration {text} but {path} is missing")
    return path


def resolve_load_dir(cfg: RunConfig) -> str | None:
    """The checkpoint to resume from, None to start fresh; a clear error for a bad --load."""
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


def check_compatible(saved: dict, cfg: RunConfig, path: str) -> None:
    """Refuse a checkpoint whose model shape differs, naming every differing flag."""
    current = cfg.to_dict()
    diffs = [
        f"--{name.replace('_', '-')}: checkpoint {saved[group][name]!r}, now {current[group][name]!r}"
        for group, names in SHAPE_FIELDS.items()
        for name in names
        if saved[group].get(name) != current[group][name]
    ]
    if diffs:
        raise ConfigError(f"--load={path}: the checkpoint's model differs: " + "; ".join(diffs))


def check_vocab_size(saved: int | None, model, path: str) -> None:
    """Refuse a checkpoint saved with another (padded) vocabulary size, before any tensor is loaded."""
    now = getattr(model[0].module, "vocab_size", None)
    if saved is not None and now is not None and saved != now:
        raise ConfigError(
            f"--load={path}: the checkpoint's padded vocabulary size is {saved}, this run's is {now} "
            f"(--tokenizer-model / --make-vocab-size-divisible-by); use the tokenizer it was saved with"
        )


def check_tensor_names(path: str, model_state: dict) -> None:
    """Refuse a checkpoint that lacks tensors of this model (another model definition) or holds them in
    other shapes (e.g. another vocabulary), naming some of each."""
    tensors = [t for t in nested_values(model_state) if isinstance(t, ShardedTensor)]
    metadata = dist_checkpointing.load_tensors_metadata(path)
    integrity.check_tensor_shapes(path, {t.key: t.global_shape for t in tensors}, metadata)
    wanted = {t.key for t in tensors}
    stored = set(metadata)
    missing = sorted(wanted - stored)
    if missing:
        extra = sorted(k for k in stored - wanted if "/shard_" not in k and not k.startswith("optimizer."))
        raise ConfigError(
            f"--load={path}: the checkpoint lacks {len(missing)} of this model's {len(wanted)} tensors "
            f"(e.g. {', '.join(missing[:3])}) and holds {len(extra)} this model does not have"
            f"{' (e.g. ' + ', '.join(extra[:3]) + ')' if extra else ''}. It was written by another model "
            f"definition (e.g. megatron_moe before the modular MoE layer, or custom experts); load it with the "
            f"code that wrote it, or start fresh without --load"
        )


EXTRA_STATE = "._extra_state"


def load_model_state(module, state: dict, path: str) -> None:
    """`module.load_state_dict(state)` where only a module's `_extra_state` may be missing from the checkpoint.

    transformer-engine's DotProductAttention has one (its FP8 metadata) that megatron-core's
    TEDotProductAttention leaves out of its sharded state dict: no checkpoint holds it, whether saved with
    transformer-engine or without, so a TE model keeps its own. Any other missing or unexpected key is refused.
    """
    result = module.load_state_dict(state, strict=False)
    missing = [key for key in result.missing_keys if not key.endswith(EXTRA_STATE)]
    if missing or result.unexpected_keys:
        raise ConfigError(
            f"--load={path}: the loaded state lacks {len(missing)} of this model's entries (e.g. "
            f"{', '.join(missing[:3]) or '-'}) and has {len(result.unexpected_keys)} it does not have (e.g. "
            f"{', '.join(result.unexpected_keys[:3]) or '-'})"
        )


def _materialize_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer its Adam state so a checkpoint can load into it.

    Its sharded_state_dict needs existing state (megatron-core does this itself
    only for FSDP). One Adam step with zero gradients at lr=0 and no weight decay
    creates the state without moving any weight; loading then overwrites it.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or opt.optimizer.state:
            continue
        saved = [(g["lr"], g["weight_decay"]) for g in opt.optimizer.param_groups]
        for group in opt.optimizer.param_groups:
            group["lr"], group["weight_decay"] = 0.0, 0.0
        opt._init_optimizer_states_with_dummy_values()
        for group, (lr, wd) in zip(opt.optimizer.param_groups, saved):
            group["lr"], group["weight_decay"] = lr, wd


def load_checkpoint(path: str, cfg: RunConfig, model, optimizer, scheduler) -> TrainState:
    """Load `path` into this layout; returns the training position to continue from."""
    if not integrity.verify_manifest(path):
        log.warning("--load=%s: saved without %s, files not verified", path, integrity.MANIFEST, extra=ONCE)
    common = dist_checkpointing.load_common_state_dict(path)
    check_compatible(common["config"], cfg, path)
    check_vocab_size(common.get("vocab_size"), model, path)
    same_layout = {"esp": 1, "vpp": 1, **common["layout"]} == _layout()  # saved before ESP / VPP: 1
    with_optimizer = not cfg.checkpoint.no_load_optim and common["has_optimizer"]
    saved_distributed = common["distributed_optimizer"]
    if with_optimizer and saved_distributed != cfg.parallel.use_distributed_optimizer:
        # The two keep different state: the distributed one also saves fp32 main params.
        raise ConfigError(
            f"--load={path}: its optimizer state was saved with --use-distributed-optimizer="
            f"{saved_distributed}, this run has {cfg.parallel.use_distributed_optimizer}; use the same "
            f"setting, or --no-load-optim to load the weights only"
        )
    with_rng = same_layout and not cfg.checkpoint.no_load_rng
    if with_optimizer:
        _materialize_optimizer_state(optimizer)
    request = _sharded_state(model, optimizer, with_optimizer=with_optimizer, with_rng=with_rng, is_loading=True)
    keys = model_state_keys(model)
    check_tensor_names(path, {key: request[key] for key in keys})
    state = dist_checkpointing.load(request, path)
    for key, chunk in zip(keys, model):
        load_model_state(chunk.module, state[key], path)
    if with_optimizer:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(common["scheduler"])
    if with_rng and not _set_rng_state(state["rng_state"]):
        log.warning(
            "checkpoint RNG states were saved on %s, this run is on %s: not restored",
            state["rng_state"].get("device_type", "cpu"),
            current_platform().device.type,
            extra=ONCE,
        )
    elif not with_rng and not cfg.checkpoint.no_load_rng:
        log.warning(
            "checkpoint layout %s differs from %s: RNG states not restored", common["layout"], _layout(), extra=ONCE
        )
    train_state = TrainState(**common["train_state"])
    log.info(
        "loaded %s (iteration %d, optimizer %s)",
        path,
        train_state.iteration,
        "restored" if with_optimizer else "fresh",
        extra=ONCE,
    )
    return train_state
