"""--moe-overlap-choice auto at start-up: the features `overlap/choice.py` decides, for this run, before the overlap
runtime and the model are built (so the run goes on as if the chosen flags had been typed).

Inputs: the run's config, the transformer config (this rank's layers, as megatron-core will build them), the
cluster's fits. Output: (the config the run goes on with, the `OverlapChoice` or None where nothing was chosen).
Every rank calls `choose_overlap` (one collective: the candidates' predicted steps, maxed over the world).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig

from megatron_moe import comm
from megatron_moe.config import RunConfig
from megatron_moe.config.fields import ConfigError
from megatron_moe.config.moe_layer import AUTO
from megatron_moe.config.rules import parse_pieces, parse_ranges
from megatron_moe.config.rules_overlap import check_batch_overlap, check_pipelined_micro_batches
from megatron_moe.overlap.choice import FEATURES, OverlapChoice, candidates, decide, stage_times
from megatron_moe.overlap.choice import step_ms as predicted_step_ms
from megatron_moe.overlap.cost_model import ClusterFits, Schedule
from megatron_moe.overlap.degrees import plan_degrees
from megatron_moe.overlap.op_partition import plan_partition, stage_model
from megatron_moe.training.setup import partition_planned

log = logging.getLogger("megatron_moe")


def chunk_layers(config: TransformerConfig) -> list[list[int]]:
    """This rank's model chunks' decoder layer numbers (from 1), as megatron-core's block builds them."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    chunks = []
    for vp_stage in range(config.virtual_pipeline_model_parallel_size or 1):
        stage = vp_stage if config.virtual_pipeline_model_parallel_size else None
        offset = get_transformer_layer_offset(config, vp_stage=stage)
        count = get_num_layers_to_build(config, vp_stage=stage)
        chunks.append(list(range(offset + 1, offset + count + 1)))
    return [layers for layers in chunks if layers]


def with_features(cfg: RunConfig, open_features, on) -> RunConfig:
    """`cfg` with each feature the choice decides set as `on` says (the others as given)."""
    moe = cfg.moe
    changes = {}
    if "batch" in open_features:
        changes["overlap_moe_expert_parallel_comm"] = "batch" in on
    if "wgrad" in open_features:
        changes["overlap_wgrad"] = moe.overlap_wgrad if "wgrad" in on else "off"
    if "pipeline" in open_features and "pipeline" not in on:
        changes |= {"moe_pipeline_degree": "1", "moe_bp_pipeline_degree": "1"}
    if "partition" in open_features and "partition" not in on:
        changes["moe_partition_pieces"] = "1"
    return dataclasses.replace(cfg, moe=dataclasses.replace(moe, **changes)) if changes else cfg


def given_degrees(cfg: RunConfig, solved: dict[int, Schedule]) -> dict[int, Schedule]:
    """The solver's degrees where the flags say auto, the flags' integers elsewhere (as the layers will run)."""
    flags = cfg.moe.moe_pipeline_degree, cfg.moe.moe_bp_pipeline_degree
    forward, backward = (None if flag == AUTO else int(flag) for flag in flags)
    return {
        layer: dataclasses.replace(s, forward=forward or s.forward, backward=backward or s.backward)
        for layer, s in solved.items()
    }


def open_features(cfg: RunConfig, micro_batches: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """(the features the choice decides, feature -> why one is left as given)."""
    moe, fixed, open_ = cfg.moe, {}, []
    if moe.overlap_moe_expert_parallel_comm:
        fixed["batch"] = "given on"
    elif micro_batches < 2:
        fixed["batch"] = f"{micro_batches} micro-batch a step: nothing to pair"
    else:
        try:
            trial = with_features(cfg, ("batch",), {"batch"})
            check_batch_overlap(trial)
            check_pipelined_micro_batches(trial, micro_batches)
            open_.append("batch")
        except ConfigError as refused:
            fixed["batch"] = f"off: {refused}"
    if moe.overlap_wgrad == "greedy" and not moe.delay_wgrad_compute:
        open_.append("wgrad")
    else:
        fixed["wgrad"] = f"--overlap-wgrad {moe.overlap_wgrad}" + (" (--delay-wgrad-compute)" * moe.delay_wgrad_compute)
    if moe.moe_pipeline_degree == AUTO and moe.moe_bp_pipeline_degree == AUTO:
        open_.append("pipeline")
    else:
        fixed["pipeline"] = f"--moe-pipeline-degree {moe.moe_pipeline_degree} / {moe.moe_bp_pipeline_degree}"
    if partition_planned(cfg):
        open_.append("partition")
    return tuple(f for f in FEATURES if f in open_), fixed


def paired_degrees(schedules: dict[int, Schedule], pipeline_size: int) -> dict[int, Schedule]:
    """The degrees a pass paired under batch-level overlap runs (`moe.handover.chunked`, as overlap/batch.py's
    `combined_step` says): the forward whole; the backward whole without PP, where the schedule says which backward
    runs alone, and at its degree under PP, where it does not."""
    return {
        layer: dataclasses.replace(s, forward=1, backward=s.backward if pipeline_size > 1 else 1)
        for layer, s in schedules.items()
    }


def choose_overlap(
    cfg: RunConfig, config: TransformerConfig, fits: ClusterFits | None, source: str
) -> tuple[RunConfig, OverlapChoice | None]:
    """The module docstring's choice; logged on rank 0."""
    if cfg.moe.moe_overlap_choice != "auto" or not (cfg.moe.is_moe and cfg.moe.own_layer):
        return cfg, None
    if fits is None or fits.missing_dense():
        why = source if fits is None else f"the profile has no {', '.join(fits.missing_dense())} lines"
        if dist.get_rank() == 0:
            log.info("overlap choice: every flag as given (%s)", why)
        return cfg, None
    micro_batches = cfg.num_microbatches(dist.get_world_size())
    features, fixed = open_features(cfg, micro_batches)
    schedules = given_degrees(cfg, plan_degrees(cfg, fits))
    layers = chunk_layers(config)
    pp = cfg.parallel.pipeline_model_parallel_size
    pieces = parse_pieces(cfg.moe.moe_partition_pieces, cfg.training.micro_batch_size)
    ranges = parse_ranges(cfg.moe.moe_partition_range, cfg.model.num_layers)

    def partitioned(stage):
        plan = plan_partition(fits, stage, pieces=pieces, ranges=ranges)
        return plan.predicted_ms["partitioned"], 0.0

    tried = candidates(features)
    steps = []
    for candidate in tried:
        trial = with_features(cfg, features, candidate.on)
        solved = schedules if "pipeline" in candidate.on or "pipeline" not in features else None  # None: r = 1
        stages = [stage_model(trial, chunk, solved) for chunk in layers]
        paired = None
        if "batch" in candidate.on and solved:
            paired = [stage_model(trial, chunk, paired_degrees(solved, pp)) for chunk in layers]
        times = stage_times(fits, stages, candidate, partitioned, paired)
        steps.append(predicted_step_ms(times, micro_batches, pp))
    with comm.host_read("overlap choice"):
        agreed = comm.agree_predictions(torch.tensor(steps, dtype=torch.float64)).tolist()
    table = {candidate.label(): ms for candidate, ms in zip(tried, agreed)}
    on = decide(features, table)
    choice = OverlapChoice(open=features, on=on, steps=table, fixed=fixed)
    if dist.get_rank() == 0:
        log.info("overlap choice (cost model, profile %s): %s", source, choice.text())
    return with_features(cfg, features, on), choice
