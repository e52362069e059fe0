"""Pretraining: start-up, the model/optimizer set-up, the loop and its logging.

`pretrain(cfg)` runs a job end to end. `_train`'s order: tokenizer, config, the cluster's fits, the overlap choice
(`--moe-overlap-choice auto`: the run goes on with the chosen flags), the `OverlapRuntime`, the model (the runtime
attached once), the planners (their results put on the runtime), the optimizer, the checkpoint, the data, then the
`Trainer` (given the runtime).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch.distributed as dist

from megatron_moe import comm
from megatron_moe.checkpointing import TrainState, check_save_dir, load_checkpoint, resolve_load_dir
from megatron_moe.checkpointing.lock import SaveLock, SaveLockBusy
from megatron_moe.checkpointing.paths import saved_iteration
from megatron_moe.config import RunConfig
from megatron_moe.data.fingerprint import data_record
from megatron_moe.data.tokenizer import build_tokenizer
from megatron_moe.failure import ONCE, exit_now
from megatron_moe.model import run_fusions, transformer_config
from megatron_moe.overlap.runtime import OverlapPlans
from megatron_moe.platform.rng import get_rng_states, set_rng_states
from megatron_moe.training.cost_profile import cluster_fits, log_profile
from megatron_moe.training.data import build_run_data
from megatron_moe.training.initialize import initialize, shutdown, start_watchdog
from megatron_moe.training.loop import Trainer
from megatron_moe.training.overlap_choice import choose_overlap
from megatron_moe.training.preemption import StopSignals
from megatron_moe.training.setup import (
    build_ddp_model,
    build_optimizer,
    build_overlap_runtime,
    build_scheduler,
    install_grad_reduce_plan,
    install_operator_partition,
    install_shadow_costs,
    link_fits,
    resolve_pipeline_degrees,
    unwire_model_config,
    wire_model_config,
)
from megatron_moe.training.summary import log_startup_summary, parameter_counts

log = logging.getLogger("megatron_moe")


def pretrain(cfg: RunConfig, *, keep_process_group: bool = False) -> list[dict]:
    """Train as `cfg` says; returns per-step figures (lm loss, grad norm) on the logging rank.

    `keep_process_group` leaves torch.distributed up (tests run several layouts in one job).
    An exception propagates without `shutdown()`: its barrier would wait for ranks that are inside a
    training collective (a hang until the timeout); the caller ends the process (pretrain_gpt_moe.main).
    """
    rank = int(os.environ.get("RANK", 0))
    # SIGTERM and SIGINT set a flag from here on, on every rank: the loop saves and exits at the next step.
    with StopSignals(enabled=cfg.checkpoint.exit_signal_handler, rank=rank) as signals:
        check_save_dir(cfg)  # filesystem only: refused before any process group or model
        lock, refusal = take_save_lock(cfg)
        try:
            initialize(cfg)
            refusal = comm.agree_startup_refusal(refusal)  # every rank ends alike, before the model
            if refusal:
                raise SaveLockBusy(refusal)
            watchdog = start_watchdog(cfg, end_job=end_job_with_report)
            try:
                with comm.monitoring(watchdog) if watchdog else contextlib.nullcontext():
                    history = _train(cfg, watchdog, signals)
                    shutdown(destroy_process_group=not keep_process_group)
            finally:
                if watchdog:
                    watchdog.stop()
        finally:
            if lock:
                lock.release()
    return history


def take_save_lock(cfg: RunConfig) -> tuple[SaveLock | None, str | None]:
    """Rank 0 takes the `--save` directory's lock: (the lock, None), or (None, why it is refused); the other
    ranks (and a run without --save) take none."""
    if cfg.checkpoint.save is None or int(os.environ.get("RANK", 0)) != 0:
        return None, None
    try:
        return SaveLock.take(cfg.checkpoint.save), None
    except SaveLockBusy as busy:
        return None, str(busy)


def _train(cfg: RunConfig, watchdog, signals: StopSignals) -> list[dict]:
    tokenizer = build_tokenizer(cfg.data)
    load_dir = resolve_load_dir(cfg)
    if (saved := saved_iteration(load_dir)) is not None and saved >= cfg.training.train_iters:
        log.info(  # not "trained 0 iterations" after a model built, a validation and a re-save
            "checkpoint at iteration %d >= --train-iters %d: nothing to train (%s); raise --train-iters to train on, "
            "or give another --load/--save to start a new run",
            saved,
            cfg.training.train_iters,
            load_dir,
            extra=ONCE,
        )
        return []
    fusions = run_fusions(cfg)
    config = transformer_config(cfg, fusions)
    rng = get_rng_states()  # the profile's micro-benchmarks draw: the model's weights must not depend on them
    fits, source, profile = cluster_fits(cfg)
    set_rng_states(rng)
    cfg, choice = choose_overlap(cfg, config, fits, source)  # the run goes on with the chosen flags
    if choice is not None:
        config = transformer_config(cfg, fusions)  # which set the model's (batch-level overlap: its schedules)
    overlap = build_overlap_runtime(cfg)
    model = build_ddp_model(cfg, config, tokenizer.vocab_size, overlap)
    overlap.grad_reduce = install_grad_reduce_plan(cfg, model, fits)
    partition_plan = overlap.grad_reduce.partition if overlap.grad_reduce else None
    schedules = resolve_pipeline_degrees(cfg, model, fits, source, partition_plan, quiet=profile is not None)
    log_profile(profile, schedules)
    partition = install_operator_partition(cfg, model, fits, source, schedules)
    install_shadow_costs(cfg, model, fits, source)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    wire_model_config(cfg, config, model, optimizer)
    record = data_record(cfg.data.data_path, cfg.data.mock_data)  # cheap: sizes, the .idx, 64 KiB of each .bin
    state = load_checkpoint(load_dir, cfg, model, optimizer, scheduler, data=record) if load_dir else TrainState()
    data = build_run_data(cfg, tokenizer, state.consumed_train_samples, record)
    counts = parameter_counts(cfg, model)
    if dist.get_rank() == 0:
        log_startup_summary(cfg, counts, tokenizer, data.sizes, fusions)
    overlap.plans = OverlapPlans(
        degrees=schedules or {}, partition=partition, grad_reduce=partition_plan, choice=choice
    )
    overlap.fits = link_fits(cfg, fits)
    overlap.on_started = profile.save if profile else None  # a launch that fails before leaves no profile
    startup = {
        "parameters": counts,
        "datasets": data.sizes,
        "tokenizer": tokenizer.description,
        "fusions": fusions.on(),
        "operator_partition": partition,
        "overlap_choice": None if choice is None else {"on": sorted(choice.on), "steps_ms": choice.steps},
    }
    trainer = Trainer(
        cfg,
        model,
        optimizer,
        scheduler,
        state,
        data,
        watchdog=watchdog,
        startup=startup,
        overlap=overlap,
        signals=signals,
    )
    try:
        return trainer.train()
    finally:
        unwire_model_config(config, model)


def end_job_with_report(report: str) -> None:
    """The watchdog's deadline: the report, then this process ends at once (torchrun stops the others); the save
    lock and a partial save are removed on the way (`failure.exit_now`)."""
    log.error("%s: ending the job", report)
    exit_now(1)
