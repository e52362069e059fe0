"""The cost model's profile at start-up: reused or measured (`megatron_moe.overlap.profiler.obtain_profile`), said
in one line (the whole table with --verbose, and always in the file beside the profile), written once the run
has started (`Profile.save`, called by the trainer after its first iteration)."""

from __future__ import annotations

import logging

import torch.distributed as dist

from megatron_moe.config import RunConfig
from megatron_moe.config.moe_layer import AUTO
from megatron_moe.model.builder import params_dtype
from megatron_moe.overlap.cost_model import ClusterFits, Schedule
from megatron_moe.overlap.degrees import layer_sizes
from megatron_moe.overlap.profile_cache import FitCheck, default_cache_dir, fits_table, quality, table_path, usable_fits
from megatron_moe.overlap.profiler import UNREADABLE, Profile, ProfileGroups, obtain_profile
from megatron_moe.training.setup import adaptive_grad_reduce, partition_planned, profile_settings

log = logging.getLogger(__name__)
UNRELIABLE = "the cost profile is not to be trusted"


def cluster_fits(cfg: RunConfig) -> tuple[ClusterFits | None, str, Profile | None]:
    """The cost model's fits when a choice needs them (pipeline degrees auto, the adaptive gradient partition, the
    shadows' or the operator partition's auto, --moe-overlap-choice auto; before the model is built):
    `--moe-cost-profile`, else this cluster's file in `--cost-profile-cache`, reused when its fingerprint is this
    run's, else measured on this run's EP / ESP / DP groups. (fits, source for the log lines, the profile); fits
    None where nothing needs them (the profile None too) or where a line they need is not to be trusted
    (`profile_cache.usable_fits`: the choices' defaults). Every rank calls it (collective)."""
    moe = cfg.moe
    auto = AUTO in (moe.moe_pipeline_degree, moe.moe_bp_pipeline_degree, moe.moe_shadow_experts)
    dense = partition_planned(cfg) or moe.moe_overlap_choice == AUTO  # the simulations need the dense lines
    if not (moe.is_moe and moe.own_layer) or not (auto or adaptive_grad_reduce(cfg) or dense):
        return None, "no choice needs the cost model", None
    sizes = layer_sizes(cfg)
    if sizes.ep * sizes.esp == 1:
        return None, "EP = ESP = 1: no all-to-all or all-gather to pipeline", None
    profile = obtain_profile(
        moe.moe_cost_profile,
        ProfileGroups.from_parallel_state(),
        profile_settings(sizes, cfg, dense=dense),
        cache_dir=None if moe.moe_cost_profile else moe.cost_profile_cache or default_cache_dir(),
        dtype=str(params_dtype(cfg)),
        remeasure=moe.cost_profile_remeasure,
        check=FitCheck(min_r2=moe.cost_profile_min_r2),
    )
    if cfg.logging.verbose and dist.get_rank() == 0:
        log.info("%s", fits_table(profile.fits, "measured" if profile.measured else f"from {profile.path}").rstrip())
    fits = usable_fits(profile.fits, profile.problems)
    return fits, UNRELIABLE if fits is None else ("measured" if profile.measured else "reused"), profile


def degrees_text(schedules: dict[int, Schedule] | None) -> str:
    """'pipeline degrees 3/1 (forward/backward)', per layer where they differ; '' where nothing was auto."""
    if not schedules:
        return ""
    pairs = {n: f"{s.forward}/{s.backward}" for n, s in schedules.items()}
    if len(set(pairs.values())) == 1:
        return f"pipeline degrees {next(iter(pairs.values()))} (forward/backward)"
    return "pipeline degrees (forward/backward) " + ", ".join(f"L{n} {pair}" for n, pair in pairs.items())


def profile_line(profile: Profile, schedules: dict[int, Schedule] | None) -> tuple[int, str]:
    """(log level, the cost model's one start-up line): how the profile was got and where it is, the fits'
    quality, the degrees chosen, where the whole table is. A warning naming the lines not to be trusted."""
    table = f"table: {table_path(profile.path)}" if profile.path else "table: --verbose"
    if not profile.trusted:
        lines = "; ".join(f"{kind} ({why})" for kind, why in profile.problems.items())
        usable = usable_fits(profile.fits, profile.problems) is not None
        fallback = (
            "the operator partition is not planned"
            if usable
            else "auto choices take their defaults: pipeline degree 1, megatron-core's gradient buckets, no shadows"
        )
        if profile.measured:
            saved = f"; saved with this verdict to {profile.path} after the first iteration" if profile.path else ""
            got = f"measured twice, not to be trusted: {lines}; {fallback}{saved}"
        else:
            got = f"the profile reused from {profile.path} is not to be trusted: {lines}; {fallback}"
        return logging.WARNING, f"cost model: {got}; --cost-profile-remeasure to measure again; {table}"
    if profile.measured:
        where = f", saved to {profile.path} after the first iteration" if profile.path else ""
        got = f"profile measured in {profile.seconds:.1f} s ({profile.why}){where}"
    else:
        got = f"profile reused from {profile.path} ({profile.why}; --cost-profile-remeasure to measure again)"
    parts = [got, quality(profile.fits), degrees_text(schedules), table]
    level = logging.WARNING if profile.why.startswith(UNREADABLE) else logging.INFO  # a cache file ignored
    return level, "cost model: " + "; ".join(part for part in parts if part)


def log_profile(profile: Profile | None, schedules: dict[int, Schedule] | None) -> None:
    """`profile_line` on rank 0 (every rank holds the same profile and degrees)."""
    if profile is not None and dist.get_rank() == 0:
        level, line = profile_line(profile, schedules)
        log.log(level, "%s", line)
