"""The run config's rules: what each flag group checks alone, and what spans groups (`check_run`).

The groups' dataclasses (`groups.py`) are the schema: the flags, their defaults and help. The checks live here,
one function per group, each error naming the flag, its value and a valid choice (`fields.require`). A few fill
what was left unset from what was given (the watchdog's seconds from the timeout, the global batch from the
micro-batch and DP, --train-iters from --train-samples); `check_run` runs them in the order the defaults need.
The layout's degrees and sizes are `ParallelDims`'s (`parallel_dims.py`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from megatron_moe.config.features import refuse_blocked
from megatron_moe.config.fields import (
    Collector,
    ConfigError,
    require,
    require_finite_floats,
    require_fraction,
    require_non_negative,
    require_positive,
)
from megatron_moe.config.gate_traits import gates_where
from megatron_moe.config.groups import (
    ModelConfig,
    MoEConfig,
    ParallelConfig,
)
from megatron_moe.config.moe_layer import group_limited_error
from megatron_moe.config.parallel_dims import ParallelDims
from megatron_moe.config.pipeline_layout import check_virtual_pipeline
from megatron_moe.config.rules_attention import check_attention, check_attention_parallel
from megatron_moe.config.rules_groups import (  # re-exported: the single-group checks
    check_activations,
    check_checkpoint,
    check_data,
    check_logging,
    check_training,
    resolve_train_iters,
)
from megatron_moe.config.rules_mtp import check_mtp
from megatron_moe.config.rules_optimizer import check_optimizer
from megatron_moe.config.rules_overlap import check_batch_overlap, check_pipelined_micro_batches

if TYPE_CHECKING:
    from megatron_moe.config import RunConfig

MCORE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
"""megatron-core's MoE layer's --moe-router-load-balancing-type choices (as this CLI offers them)."""


def check_run(cfg: RunConfig, world_size: int) -> None:
    """Check every group, then what spans groups; fill derived defaults. Every error is found in one pass: each
    group's check runs where the groups it reads passed (moe reads model; parallel both), a group with a
    non-finite float is checked no further, and the checks across groups run where the groups they read passed;
    several errors are raised together (`fields.ConfigErrors`)."""
    errors = Collector()
    failed = set()

    def dims() -> ParallelDims:  # no chunks yet: their flags are checked in check_parallel
        return ParallelDims.from_config(cfg.parallel, world_size)

    for name, needs, check in (
        ("model", (), lambda: (check_model(cfg.model), check_mtp(cfg))),
        ("moe", ("model",), lambda: check_moe(cfg.moe, cfg.model, cfg.parallel)),
        ("parallel", ("model", "moe"), lambda: check_parallel(cfg.parallel, dims(), cfg.model, cfg.moe)),
        ("training", (), lambda: check_training(cfg.training)),
        ("activations", (), lambda: (check_activations(cfg.activations), cfg.activation_policy())),
        ("data", (), lambda: check_data(cfg.data)),
        ("checkpoint", (), lambda: check_checkpoint(cfg.checkpoint)),
        ("logging", (), lambda: check_logging(cfg.logging)),
    ):
        if failed.intersection(needs):  # its checks read a group in error: they would repeat its error
            failed.add(name)
            continue
        found = len(errors.errors)
        with errors:
            require_finite_floats(getattr(cfg, name))  # before the range checks, which NaN would slip through
            check()  # (activations: names and formats checked before any process group exists)
        if len(errors.errors) > found:
            failed.add(name)
    if not failed & {"model", "moe", "parallel", "training"}:
        with errors:
            check_batch(cfg, world_size)
            check_interleaved_microbatches(cfg, world_size)
            check_pipelined_micro_batches(cfg, cfg.num_microbatches(world_size))
        with errors:
            check_partition(cfg)
        with errors:
            check_batch_overlap(cfg)
        with errors:
            require(
                cfg.model.seq_length % cfg.dims(world_size).sequence_split == 0,
                "--seq-length",
                cfg.model.seq_length,
                "must be a multiple of --tensor-model-parallel-size under --sequence-parallel",
            )
    if not failed & {"parallel", "training"}:
        with errors:
            check_optimizer(cfg)
    with errors:
        require(
            not (cfg.moe.overlap_report and cfg.logging.no_comm_timers),
            "--overlap-report",
            True,
            "without --no-comm-timers (the report sets the timers' figures beside the plans)",
        )
    errors.raise_all()


def check_batch(cfg: RunConfig, world_size: int) -> None:
    """The global batch (filled from the micro-batch and DP where unset) holds whole micro-batches on every
    data-parallel rank; --train-iters filled."""
    dp = cfg.dims(world_size).dp
    t = cfg.training
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    resolve_train_iters(t)
    require(
        t.global_batch_size % (t.micro_batch_size * dp) == 0,
        "--global-batch-size",
        t.global_batch_size,
        f"must be a multiple of --micro-batch-size x data-parallel size = "
        f"{t.micro_batch_size} x {dp} = {t.micro_batch_size * dp}",
    )


def check_interleaved_microbatches(cfg: RunConfig, world_size: int) -> None:
    """megatron-core's interleaved schedule runs the micro-batches in groups of PP per model chunk: their number
    must be a multiple of PP (at least PP)."""
    t, dims = cfg.training, cfg.dims(world_size)
    chunks = dims.vpp
    if chunks is None:
        return
    pp, microbatches = dims.pp, cfg.num_microbatches(world_size)
    per_step = t.micro_batch_size * dims.dp
    require(
        microbatches % pp == 0,
        "--global-batch-size",
        t.global_batch_size,
        f"the interleaved pipeline ({chunks} model chunks per pipeline rank) needs a number of micro-batches "
        f"that is a multiple of --pipeline-model-parallel-size={pp}, and global batch / (micro-batch x "
        f"data-parallel size) = {t.global_batch_size} / ({t.micro_batch_size} x "
        f"{dims.dp}) = {microbatches}; e.g. --global-batch-size "
        f"{per_step * pp * max(1, -(-microbatches // pp))}",
    )


PIECES_FLAG, RANGE_FLAG = "--moe-partition-pieces", "--moe-partition-range"
_RANGE = re.compile(r"^(\d+)-(\d+)$")


def parse_ranges(text: str, num_layers: int) -> list[tuple[int, int]] | None:
    """--moe-partition-range: "auto" -> None (the planner picks), "all" -> [(1, num_layers)], else
    "FIRST-LAST[,FIRST-LAST...]" -> [(first, last), ...]: 1 <= FIRST <= LAST <= num_layers, ascending, disjoint."""
    text = text.strip()
    if text == "auto":
        return None
    if text == "all":
        return [(1, num_layers)]
    example = f"auto, all, or e.g. 1-{min(2, num_layers)}"
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        match = _RANGE.match(part.strip())
        require(match is not None, RANGE_FLAG, text, f"{part.strip()!r} is not FIRST-LAST; {example}")
        first, last = int(match[1]), int(match[2])
        require(
            1 <= first <= last <= num_layers,
            RANGE_FLAG,
            text,
            f"{first}-{last}: needs 1 <= FIRST <= LAST <= {num_layers} (--num-layers); {example}",
        )
        require(
            not out or first > out[-1][1],
            RANGE_FLAG,
            text,
            f"{first}-{last} after {out[-1][0] if out else 0}-{out[-1][1] if out else 0}: ranges ascending, disjoint",
        )
        out.append((first, last))
    return out


def parse_pieces(text: str | int, micro_batch: int) -> int | None:
    """--moe-partition-pieces: "auto" -> None (the planner picks, at most min(MAX_PIECES, B)), else N in 1..B
    (1: off)."""
    if str(text).strip() == "auto":
        return None
    value = str(text).strip()
    require(value.isdigit() and int(value) >= 1, PIECES_FLAG, text, "auto or an integer >= 1 (1: off), e.g. 2")
    require(
        int(value) <= micro_batch,
        PIECES_FLAG,
        text,
        f"at most --micro-batch-size = {micro_batch} (the pieces split the batch); e.g. auto",
    )
    return int(value)


def check_partition(cfg: RunConfig) -> None:
    """Lancet's operator partition: pieces of a micro-batch route as the micro-batch only where each token routes
    alone (no capacity, no noise), and the pieces need sequences to split and a forward that can pause. auto is
    the planner's, checked the same way where it could split."""
    moe, t = cfg.moe, cfg.training
    if not moe.own_layer:
        return
    pieces = parse_pieces(moe.moe_partition_pieces, t.micro_batch_size)
    ranges = parse_ranges(moe.moe_partition_range, cfg.model.num_layers)
    pattern = moe.layer_pattern(cfg.model.num_layers)
    for first, last in ranges or ():
        require(
            any(pattern[first - 1 : last]),
            RANGE_FLAG,
            moe.moe_partition_range,
            f"a range with an MoE layer in it (layers {first}-{last} have none; MoE layers: "
            f"{[i + 1 for i, moe_layer in enumerate(pattern) if moe_layer]})",
        )
    if pieces == 1 or (pieces is None and t.micro_batch_size == 1):
        return
    why_not = partition_blocker(cfg)
    require(pieces is None or why_not is None, PIECES_FLAG, moe.moe_partition_pieces, f"1 with {why_not}")


def partition_blocker(cfg: RunConfig) -> str | None:
    """What keeps this run's micro-batches whole (a clause naming the flag), or None."""
    moe = cfg.moe
    if moe.moe_expert_capacity_factor:
        return (
            f"--moe-expert-capacity-factor {moe.moe_expert_capacity_factor}: a piece would drop other tokens than "
            "the micro-batch; dropless routing (no capacity factor) partitions"
        )
    if moe.moe_gate not in TOKEN_ALONE_GATES:
        return (
            f"--moe-gate {moe.moe_gate}: its routing depends on the whole batch or on noise drawn for its shape; "
            f"one of {', '.join(TOKEN_ALONE_GATES)} partitions"
        )
    if cfg.activations.full_recompute:
        return "full activation recompute (a recomputed layer runs whole); selective --recompute-modules partition"
    return None


TOKEN_ALONE_GATES = gates_where("tokens_alone")
"""Gates that route each token alone when nothing caps the experts (the partition may split their batch)."""


def check_model(model: ModelConfig) -> None:
    """The transformer's shape: positive sizes, dropout fractions, heads that divide the width."""
    for flag, value, example in (
        ("--num-layers", model.num_layers, 4),
        ("--hidden-size", model.hidden_size, 256),
        ("--ffn-hidden-size", model.ffn_hidden_size, 1024),
        ("--num-attention-heads", model.num_attention_heads, 4),
        ("--num-query-groups", model.num_query_groups, 1),
        ("--seq-length", model.seq_length, 256),
        ("--max-position-embeddings", model.max_position_embeddings, model.seq_length),
        ("--rotary-base", model.rotary_base, 10000),
        ("--norm-epsilon", model.norm_epsilon, 1e-5),
        ("--init-method-std", model.init_method_std, 0.02),
        ("--make-vocab-size-divisible-by", model.make_vocab_size_divisible_by, 128),
    ):
        require_positive(flag, value, example)
    require_fraction("--hidden-dropout", model.hidden_dropout, 0.1)
    require_fraction("--attention-dropout", model.attention_dropout, 0.1)
    if model.position_embedding_type == "learned_absolute" and model.max_position_embeddings is not None:
        require(
            model.seq_length <= model.max_position_embeddings,
            "--seq-length",
            model.seq_length,
            f"must be <= --max-position-embeddings={model.max_position_embeddings} (the learned-position table)",
        )
    check_attention(model)  # head widths, RoPE, MLA (rules_attention.py)
    if model.num_query_groups is not None:
        require(
            model.num_attention_heads % model.num_query_groups == 0,
            "--num-query-groups",
            model.num_query_groups,
            f"must divide --num-attention-heads={model.num_attention_heads}",
        )


def check_moe(moe: MoEConfig, model: ModelConfig, parallel=None) -> None:
    """The MoE flags (nothing without --num-experts), and our layer's MoELayerConfig where it is ours (at the run's
    EP and ESP sizes, `parallel`'s, where given)."""
    if not moe.is_moe:
        return
    require_positive("--num-experts", moe.num_experts, 8)
    require_positive("--moe-ffn-hidden-size", moe.moe_ffn_hidden_size, 1024)
    require_positive("--moe-shared-expert-ffn-hidden-size", moe.moe_shared_expert_ffn_hidden_size, 1024)
    require_positive("--moe-router-dim", moe.moe_router_dim, 16)
    require_positive("--moe-soft-slots", moe.moe_soft_slots, 1)
    require_non_negative("--moe-aux-loss-coeff", moe.moe_aux_loss_coeff, 0.01)
    require_non_negative("--moe-z-loss-coeff", moe.moe_z_loss_coeff, 0.001)
    require_non_negative("--overlap-wgrad-max-mb", moe.overlap_wgrad_max_mb, 1024)
    require_fraction("--cost-profile-min-r2", moe.cost_profile_min_r2, 0.9)  # an R^2 threshold; 0: no check
    require(
        0 < moe.moe_router_topk <= moe.num_experts,
        "--moe-router-topk",
        moe.moe_router_topk,
        f"must be between 1 and --num-experts={moe.num_experts}",
    )
    moe.layer_pattern(model.num_layers)
    if moe.own_layer and moe.moe_router_score_function is not None:
        picks = {"softmax": "topk", "sigmoid": "sigmoid"}[moe.moe_router_score_function]
        require(
            moe.moe_gate in ("topk", picks),
            "--moe-router-score-function",
            moe.moe_router_score_function,
            f"selects --moe-gate {picks}, not --moe-gate {moe.moe_gate}; drop one of the two",
        )
    require_non_negative("--moe-router-bias-update-rate", moe.moe_router_bias_update_rate, 1e-3)
    require_positive("--moe-router-num-groups", moe.moe_router_num_groups, 8)
    require_positive("--moe-router-group-topk", moe.moe_router_group_topk, 4)
    if moe.moe_router_enable_expert_bias:  # megatron-core's rule, for either layer
        require(
            moe.gate == "sigmoid" if moe.own_layer else moe.moe_router_score_function == "sigmoid",
            "--moe-router-enable-expert-bias",
            True,
            "aux-loss-free balancing biases sigmoid scores only; add --moe-router-score-function sigmoid",
        )
    group_limited_error(moe.num_experts, moe.moe_router_topk, moe.moe_router_num_groups, moe.moe_router_group_topk)
    if moe.own_layer:
        require(
            moe.moe_token_dispatcher_type == "alltoall",
            "--moe-token-dispatcher-type",
            moe.moe_token_dispatcher_type,
            "megatron_moe's layer dispatches with alltoall (allgather only with --moe-layer-impl mcore)",
        )
        layer = moe.layer_config(model).validate()  # names the flag, value and a valid choice
        if parallel is not None:  # each feature asked for by value against its blocker, at the run's sizes
            ep, esp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel
            refuse_blocked(layer, ep_size=ep, esp_size=esp, error=ConfigError)
        return
    require(
        moe.moe_router_force_biased is None,
        "--moe-router-force-biased",
        moe.moe_router_force_biased,
        "megatron-core 0.16.1's router has no forced bias (Megatron-LM added it later); our layer has it: drop "
        "--moe-layer-impl mcore, or drop the flag",
    )
    require(
        moe.moe_router_load_balancing_type in MCORE_LOAD_BALANCING,
        "--moe-router-load-balancing-type",
        moe.moe_router_load_balancing_type,
        f"megatron-core's layer (--moe-layer-impl mcore) implements {', '.join(MCORE_LOAD_BALANCING)}",
    )
    require(  # megatron-core's TransformerConfig refuses it at start-up, after "flags OK"
        moe.moe_router_topk > 1
        or moe.moe_router_score_function == "sigmoid"
        or moe.moe_router_pre_softmax
        or moe.moe_router_load_balancing_type == "sinkhorn",
        "--moe-router-topk",
        moe.moe_router_topk,
        "megatron-core's layer (--moe-layer-impl mcore) routes one expert by softmax only with "
        "--moe-router-pre-softmax (a softmax over the one chosen expert is 1: no gradient to the router); add it, or "
        "--moe-router-score-function sigmoid, or --moe-router-topk 2",
    )
    require(
        not moe.moe_pad_expert_input_to_capacity or (moe.moe_expert_capacity_factor or 0) > 0,
        "--moe-pad-expert-input-to-capacity",
        True,
        "megatron-core's layer pads only to a positive --moe-expert-capacity-factor",
    )


def check_stall_seconds(parallel: ParallelConfig) -> None:
    """The watchdog's figures (`comm/watchdog.py`); fills the unset ones from the timeout."""
    deadline_s = 60 * parallel.distributed_timeout_minutes
    stall_default = min(30.0, deadline_s / 4)
    if parallel.stall_report_seconds is None:
        parallel.stall_report_seconds = stall_default
    require(
        0 < parallel.stall_report_seconds < deadline_s,
        "--stall-report-seconds",
        parallel.stall_report_seconds,
        f"must be > 0 and below --distributed-timeout-minutes={parallel.distributed_timeout_minutes:g} "
        f"({deadline_s:g} s), e.g. --stall-report-seconds {stall_default:g}",
    )
    if parallel.dead_peer_seconds is None:
        parallel.dead_peer_seconds = 5 * parallel.stall_report_seconds
    require(
        parallel.dead_peer_seconds >= parallel.stall_report_seconds,
        "--dead-peer-seconds",
        parallel.dead_peer_seconds,
        f"must be at least --stall-report-seconds={parallel.stall_report_seconds:g} (the stall is named before "
        f"the job ends for it), e.g. --dead-peer-seconds {5 * parallel.stall_report_seconds:g}",
    )


def check_parallel(parallel: ParallelConfig, dims: ParallelDims, model: ModelConfig, moe: MoEConfig) -> None:
    """The parallel flags, and the layout `dims` (their degrees on the run's world) against the model's shape."""
    tp, pp, ep, esp = dims.tp, dims.pp, dims.ep, dims.esp
    dims.check_degrees()
    require_positive("--distributed-timeout-minutes", parallel.distributed_timeout_minutes, 10)
    require_positive("--ddp-bucket-size", parallel.ddp_bucket_size, 1_000_000)
    require(
        not (parallel.use_tp_pp_dp_mapping and parallel.expert_placement == "d+e"),
        "--expert-placement",
        parallel.expert_placement,
        "--use-tp-pp-dp-mapping orders the ranks as e+d does, the pipeline before DP; no such order puts the "
        "expert-DP replicas first: use e+d or auto with it",
    )
    instances = parallel.num_distributed_optimizer_instances
    require_positive("--num-distributed-optimizer-instances", instances, 2)
    require(
        (dims.dp * dims.cp) % instances == 0 and dims.expert_dp % instances == 0,
        "--num-distributed-optimizer-instances",
        instances,
        f"must divide DP x CP ({dims.dp * dims.cp}) and expert DP ({dims.expert_dp}): each instance is a whole "
        f"set of data-parallel ranks",
    )
    require(
        not parallel.use_tp_pp_dp_mapping or dims.pp == 1 or dims.expert_dp == dims.dp,
        "--use-tp-pp-dp-mapping",
        True,
        f"megatron-core builds the pipeline before DP only where the experts' DP equals the dense DP (TP x CP = "
        f"ESP x EP), here {dims.expert_dp} and {dims.dp} (TP={dims.tp} CP={dims.cp}, ESP={dims.esp} EP={dims.ep}); "
        f"drop the flag or make them equal",
    )
    check_stall_seconds(parallel)
    dims.check_world()
    require(
        model.num_attention_heads % tp == 0,
        "--tensor-model-parallel-size",
        tp,
        f"must divide --num-attention-heads={model.num_attention_heads}",
    )
    check_attention_parallel(model, tp, parallel.sequence_parallel)
    require(
        model.make_vocab_size_divisible_by % tp == 0,
        "--make-vocab-size-divisible-by",
        model.make_vocab_size_divisible_by,
        f"must be a multiple of --tensor-model-parallel-size={tp}",
    )
    layout = parallel.pipeline_model_parallel_layout
    require(
        model.num_layers % pp == 0 or layout is not None,
        "--pipeline-model-parallel-size",
        pp,
        f"must divide --num-layers={model.num_layers} (or place the layers unevenly: --pipeline-model-parallel-layout)",
    )
    check_virtual_pipeline(parallel, model)
    if moe.is_moe:
        ffn = moe.expert_ffn_width(model)
        require(
            ffn % esp == 0,
            "--expert-tensor-parallel-size",
            esp,
            f"must divide the experts' width --moe-ffn-hidden-size={ffn} (each expert's FFN is split over it), "
            f"e.g. {next(d for d in range(esp, 0, -1) if ffn % d == 0)}",
        )
        require(
            moe.num_experts % ep == 0,
            "--num-experts",
            moe.num_experts,
            f"must be a multiple of --expert-model-parallel-size={ep} "
            f"(e.g. --num-experts {ep * max(1, moe.num_experts // ep)})",
        )
        require(
            esp == 1 or moe.own_layer or model.disable_bias_linear,
            "--expert-tensor-parallel-size",
            esp,
            "megatron-core's layer (--moe-layer-impl mcore) has expert biases only at 1 (unset, ESP is "
            "--tensor-model-parallel-size, as in Megatron-LM): give --expert-tensor-parallel-size 1 or "
            "--disable-bias-linear",
        )
        dims.check_expert_layout()
        require(
            tp == 1 or dims.sequence_parallel,
            "--sequence-parallel",
            dims.sequence_parallel,
            f"MoE with --tensor-model-parallel-size={tp} needs --sequence-parallel",
        )
    elif ep > 1:
        require(False, "--expert-model-parallel-size", ep, "needs --num-experts; use 1 for a dense model")
