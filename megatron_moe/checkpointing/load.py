"""Loading: `load_checkpoint` verifies the checksums, then compares the model's flags, vocabulary and tensor names
with this run's before any tensor is read, loads model, optimizer, scheduler and (in the same layout) RNG states,
and returns the training state.
"""

from __future__ import annotations

import logging

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_moe.checkpointing import integrity
from megatron_moe.checkpointing.state import (
    OPTIMIZER_STATE_AT,
    SHAPE_FIELDS,
    TrainState,
    current_layout,
    model_state_keys,
    restore_rng_state,
    sharded_state,
)
from megatron_moe.config import ConfigError, RunConfig
from megatron_moe.data.fingerprint import data_changes
from megatron_moe.failure import ONCE
from megatron_moe.platform import current_platform

log = logging.getLogger("megatron_moe")


def check_compatible(saved: dict, cfg: RunConfig, path: str) -> None:
    """Refuse a checkpoint whose model shape differs, naming every differing flag."""
    current, default = cfg.to_dict(), RunConfig().to_dict()  # a flag newer than the checkpoint: its default
    diffs = [
        f"--{name.replace('_', '-')}: checkpoint {saved[group].get(name, default[group][name])!r}, "
        f"now {current[group][name]!r}"
        for group, names in SHAPE_FIELDS.items()
        for name in names
        if saved[group].get(name, default[group][name]) != current[group][name]
    ]
    if diffs:
        raise ConfigError(f"--load={path}: the checkpoint's model differs: " + "; ".join(diffs))


RECORD_KEYS = {"mock_data", "data_path", "fingerprints"}
"""What `data_record` holds."""


def check_same_data(saved: dict | None, data: dict, cfg: RunConfig, path: str) -> None:
    """Refuse to resume on other data than the checkpoint's (`data_record`s compared: --data-path, blend weights,
    each prefix's sizes, documents and contents), naming each change, unless --allow-data-change says it is
    intended (then the changes are a warning); a checkpoint saved before the record: one warning."""
    if not isinstance(saved, dict) or not RECORD_KEYS <= set(saved):  # saved before the record (or unreadable)
        log.warning("--load=%s: saved without a record of its data, so the data could not be checked", path, extra=ONCE)
        return
    changes = data_changes(saved, data)
    if not changes:
        return
    if cfg.checkpoint.allow_data_change:
        log.warning("--load=%s: resuming on other data (--allow-data-change): %s", path, "; ".join(changes), extra=ONCE)
        return
    raise ConfigError(
        f"--load={path}: the data differs from the checkpoint's: {'; '.join(changes)}. Resume on the data it was "
        "trained on, or add --allow-data-change if the change is intended"
    )


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


def misplaced_optimizer_state(common: dict, path: str) -> str | None:
    """A warning for a distributed-optimizer checkpoint saved before that fix by a run that may have had several
    gradient buckets (--overlap-grad-reduce, or the adaptive gradient partition's bucket per parameter at EP > 1):
    its parameters after the first bucket were saved with other parameters' Adam state. None for any other."""
    if (
        not common.get("distributed_optimizer")
        or not common.get("has_optimizer")
        or common.get("optimizer_state_at") == OPTIMIZER_STATE_AT
    ):
        return None
    parallel = common.get("config", {}).get("parallel", {})
    adaptive = parallel.get("grad_reduce_schedule", "adaptive") == "adaptive"
    if not parallel.get("overlap_grad_reduce") and not (adaptive and parallel.get("expert_model_parallel_size", 1) > 1):
        return None
    return (
        f"--load={path}: saved before megatron_moe fixed megatron-core 0.16.1's distributed-optimizer save with "
        f"several gradient buckets (--overlap-grad-reduce or the adaptive --grad-reduce-schedule, as this run was "
        f"saved): if it had several, the Adam moments and fp32 main weights of every parameter past the first "
        f"bucket belong to other parameters, and resuming trains differently from the saved run. Its weights are "
        f"right: --no-load-optim loads them with a fresh optimizer"
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


OPTIMIZER_KINDS = {
    "adam": "--optimizer adam",
    "distributed_adam": "--optimizer adam --use-distributed-optimizer",
    "muon": "--optimizer muon",
    "layer_wise_muon": "--optimizer muon --use-distributed-optimizer (layer-wise)",
}
"""`RunConfig.optimizer_kind` -> the flags that make it."""


def saved_optimizer_kind(common: dict) -> str:
    """The optimizer a checkpoint's state is of (`RunConfig.optimizer_kind`); saves before Muon: Adam's."""
    return common.get("optimizer_kind") or ("distributed_adam" if common["distributed_optimizer"] else "adam")


def load_checkpoint(path: str, cfg: RunConfig, model, optimizer, scheduler, *, data: dict | None = None) -> TrainState:
    """Load `path` into this layout; returns the training position to continue from. `data`: this run's
    `data_record`, checked against the checkpoint's (None: not checked, e.g. tools that only move weights)."""
    if not integrity.verify_manifest(path):
        log.warning("--load=%s: saved without %s, files not verified", path, integrity.MANIFEST, extra=ONCE)
    common = dist_checkpointing.load_common_state_dict(path)
    check_compatible(common["config"], cfg, path)
    if data is not None:
        check_same_data(common.get("data"), data, cfg, path)
    check_vocab_size(common.get("vocab_size"), model, path)
    same_layout = {"esp": 1, "vpp": 1, **common["layout"]} == current_layout()  # saved before ESP / VPP: 1
    with_optimizer = not cfg.checkpoint.no_load_optim and common["has_optimizer"]
    saved_kind = saved_optimizer_kind(common)
    if with_optimizer and saved_kind != cfg.optimizer_kind:
        # Each keeps different state: the distributed one also saves fp32 main params, Muon a momentum buffer.
        raise ConfigError(
            f"--load={path}: its optimizer state was saved by {OPTIMIZER_KINDS[saved_kind]}, this run has "
            f"{OPTIMIZER_KINDS[cfg.optimizer_kind]}; use the same --optimizer and --use-distributed-optimizer, "
            f"or --no-load-optim to load the weights only"
        )
    if with_optimizer and saved_kind == "layer_wise_muon" and not same_layout:
        raise ConfigError(
            f"--load={path}: Muon's layer-wise distributed optimizer state loads into the layout it was saved in "
            f"only (megatron-core 0.16.1 saves it for a fixed data-parallel layout: {common['layout']}); resume in "
            "that layout, or add --no-load-optim to load the weights only"
        )
    with_rng = same_layout and not cfg.checkpoint.no_load_rng
    if with_optimizer:
        if warning := misplaced_optimizer_state(common, path):
            log.warning("%s", warning, extra=ONCE)
        _materialize_optimizer_state(optimizer)
    request = sharded_state(model, optimizer, with_optimizer=with_optimizer, with_rng=with_rng, is_loading=True)
    keys = model_state_keys(model)
    check_tensor_names(path, {key: request[key] for key in keys})
    state = dist_checkpointing.load(request, path)
    for key, chunk in zip(keys, model):
        load_model_state(chunk.module, state[key], path)
    if with_optimizer:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(common["scheduler"])
    if with_rng and not restore_rng_state(state["rng_state"]):
        log.warning(
            "checkpoint RNG states were saved on %s, this run is on %s: not restored",
            state["rng_state"].get("device_type", "cpu"),
            current_platform().device.type,
            extra=ONCE,
        )
    elif not with_rng and not cfg.checkpoint.no_load_rng:
        log.warning(
            "checkpoint layout %s differs from %s: RNG states not restored",
            common["layout"],
            current_layout(),
            extra=ONCE,
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
