"""The MoE flag group: `MoEConfig`, the run-level MoE flags (`MoERunFlags`) and one flag per MoE layer setting.

The layer settings' flags are generated from `MoELayerConfig`'s `arg` fields (`fields.flag_fields`): one
declaration each, named by its flag (`cfg.moe.moe_router_topk` is --moe-router-topk), parsed once into typed
values (`__post_init__`). `layer_config(model)` turns the group into the layer's config. Checks: rules.py.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
from typing import TYPE_CHECKING

from megatron_moe.config import conditions as only
from megatron_moe.config.fields import arg, flag_attribute, flag_fields, is_flag, parse_flag_values, require
from megatron_moe.config.moe_layer import MoELayerConfig

if TYPE_CHECKING:
    from megatron_moe.config.groups import ModelConfig


@dataclasses.dataclass(kw_only=True)
class MoERunFlags:
    """Mixture of experts: how many experts, how tokens are routed, where MoE layers sit.

    The run-level MoE flags; `MoEConfig` adds one flag per MoE layer setting, generated from `MoELayerConfig`
    (its `arg` fields: the one declaration of each), so `cfg.moe.moe_router_topk` is --moe-router-topk."""

    num_experts: int | None = arg(None, "experts per MoE layer (unset: a dense model)")
    moe_layer_freq: str = arg(
        "1",
        "MoE every N layers (N, e.g. 2 = every other layer) or a 0/1 pattern, a list or Megatron-LM's list "
        "expression like '([0]+[1]*3)' (one entry per layer)",
        applies=only.MOE,
    )
    moe_ffn_hidden_size: int | None = arg(None, "expert MLP width (default --ffn-hidden-size)", applies=only.MOE)
    moe_token_dispatcher_type: str = arg(
        "alltoall",
        "token dispatch: alltoall (all-to-all over EP, exact rows unless padded); allgather only with "
        "--moe-layer-impl mcore",
        choices=("alltoall", "allgather"),
        applies=only.MOE,
    )
    moe_cost_profile: str | None = arg(
        None,
        "FSMoE's cost-model fits (JSON; tools/profile_cluster.py writes one) that resolve the auto choices "
        "(pipeline degrees, gradient partition, shadows, operator partition): reused when its fingerprint "
        "(cluster, placement, shapes, dtype, link, code version) is this run's, else measured at start-up and "
        "written there after the first iteration (unset: one file per fingerprint in --cost-profile-cache)",
        applies=only.OUR_MOE,
    )
    cost_profile_cache: str | None = arg(
        None,
        "where the cost-model profiles are cached, one per cluster fingerprint, so that runs of one set-up reuse "
        "one profile and get the same degrees (unset: $MEGATRON_MOE_CACHE_DIR/cost_profiles, else "
        "~/.cache/megatron_moe/cost_profiles; rank 0's disk: its decision reaches every rank)",
        applies=only.OUR_MOE,
    )
    cost_profile_remeasure: bool = arg(
        False,
        "measure the cost-model profile again even where a matching one is saved (it replaces it)",
        applies=only.OUR_MOE,
    )
    cost_profile_min_r2: float = arg(
        0.9,
        "a cost-model line with R^2 below this whose points are more than 25%% off it (or with a negative time) "
        "is measured once more, then left unused (also by the runs that reuse the profile): pipeline degree 1, with "
        "a warning naming it (0: no check)",
        applies=only.OUR_MOE,
    )
    moe_partition_pieces: str = arg(
        "1",
        "Lancet's operator partition: each micro-batch runs a range of layers as this many pieces along the batch, "
        "interleaved so that piece i's dispatch all-to-all is in flight under piece i+1's attention and router and "
        "its combine under the next piece's experts and the next layer; the gate, capacity and router losses stay "
        "the micro-batch's. An integer from 1 (off) to --micro-batch-size, or auto (Lancet's DP on the cost model, "
        "--moe-cost-profile: pieces and ranges per stage, none where they are not predicted faster)",
        applies=only.OUR_MOE,
    )
    moe_partition_range: str = arg(
        "auto",
        "the layers --moe-partition-pieces splits: auto (the planner's ranges), all, or FIRST-LAST[,FIRST-LAST...] "
        "(layer numbers from 1, each with an MoE layer; a range across pipeline stages splits at their boundary)",
        applies=only.OUR_MOE,
    )
    moe_router_score_function: str | None = arg(
        None,
        "Megatron-LM's router score: softmax (--moe-gate topk) or sigmoid (--moe-gate sigmoid); unset: --moe-gate",
        choices=("softmax", "sigmoid"),
        applies=only.SCORE_FUNCTION,
    )
    moe_router_pre_softmax: bool = arg(
        False,
        "Megatron-LM's pre-softmax: the k weights are the softmax over all experts, not renormalised over the k "
        "(here: --no-moe-normalize-topk)",
        applies=only.PRE_SOFTMAX,
    )
    overlap_wgrad: str = arg(
        "greedy",
        "Lancet: weight-gradient GEMMs run under the backward all-to-alls. greedy: iteration 2 is timed and "
        "Lancet's best-fit plan (Algorithm 1) runs from iteration 3 (nothing deferred where nothing hides); "
        "all-under-next-a2a: every dW under the next all-to-all; off. Bit-identical gradients either way",
        choices=("off", "greedy", "all-under-next-a2a"),
        applies=only.EXPERT_PARALLEL,
    )
    overlap_moe_expert_parallel_comm: bool = arg(
        False,
        "Megatron-LM's batch-level overlap: with two or more micro-batches in flight (gradient accumulation, the "
        "interleaved pipeline's steady state), one's forward runs beside another's backward stage by stage, so each "
        "all-to-all of one is in flight under the other's attention or experts (megatron-core's combined 1F1B "
        "schedules, on our layer's stages; bit-identical results)",
        applies=only.EXPERT_PARALLEL,
    )
    delay_wgrad_compute: bool = arg(
        False,
        "Megatron-LM's: weight gradients apart from the input gradients, under the backward all-to-alls; here "
        "Lancet's queue (--overlap-wgrad), which it needs on; only with --overlap-moe-expert-parallel-comm",
        applies=only.EXPERT_PARALLEL,
    )
    moe_overlap_choice: str = arg(
        "given",
        "auto: the cost model (its profile with the dense lines) predicts the whole step for each setting of the "
        "overlap features left at their defaults (batch-level overlap, Lancet's queue, the operator partition under "
        "auto; the pipeline degrees as their solver chooses; the adaptive gradient partition by its own plan) and "
        "turns on only those predicted to save 5%% of the step; the choice and its predicted step are logged at "
        "start-up and in --overlap-report. given: every overlap flag as given",
        choices=("given", "auto"),
        applies=only.EXPERT_PARALLEL,
    )
    overlap_wgrad_max_mb: float = arg(
        1024.0,
        "--overlap-wgrad: at most this many MiB held by queued weight-gradient inputs at once (0: no cap); "
        "a dW that would exceed it runs at its natural place",
        applies=only.EXPERT_PARALLEL,
    )
    overlap_wgrad_report: bool = arg(
        False,
        "--overlap-wgrad greedy: log the plan (which dW under which all-to-all, predicted hidden time)",
        applies=only.EXPERT_PARALLEL,
    )
    overlap_report: bool = arg(
        False,
        "log, once every overlap plan is in force (the job's steps 3-12), each planner's choice and prediction beside "
        "what the communication timers measured: per kind wire / exposed / skew / transfer time and hidden share, "
        "per MoE layer its degrees and all-to-alls, the operator partition's and the gradient partition's hidden time",
        applies=only.OUR_MOE,
    )
    moe_layer_impl: str = arg(
        "megatron_moe",
        "MoE layer: ours or megatron-core's (the layer benchmark's reference)",
        choices=("megatron_moe", "mcore"),
        applies=only.MOE,
    )
    moe_grouped_gemm: bool = arg(
        False, "megatron-core's grouped-GEMM experts (needs the grouped_gemm package)", applies=only.MCORE_MOE
    )

    def __post_init__(self):
        parse_flag_values(self)  # typed values whoever built the group: no flag text is compared after this

    @property
    def topk_normalized(self) -> bool:
        """The k combine weights renormalised to sum to 1: --moe-normalize-topk, unless Megatron-LM's
        --moe-router-pre-softmax takes them from the softmax over all experts."""
        return self.moe_normalize_topk and not self.moe_router_pre_softmax

    def expert_ffn_width(self, model: ModelConfig) -> int:
        """One routed expert's MLP width: --moe-ffn-hidden-size, else the dense MLP's (`ModelConfig.ffn_width`)."""
        return self.moe_ffn_hidden_size or model.ffn_width

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def own_layer(self) -> bool:
        """True when the MoE layers are megatron_moe's (not megatron-core's)."""
        return self.is_moe and self.moe_layer_impl == "megatron_moe"

    @property
    def gate(self) -> str:
        """Our layer's gate: --moe-gate, or the one --moe-router-score-function names (sigmoid: the sigmoid gate),
        or the one --moe-router-load-balancing-type sinkhorn names (the sinkhorn gate, megatron-core's routing)."""
        if self.moe_router_load_balancing_type == "sinkhorn":
            return "sinkhorn"
        return "sigmoid" if self.moe_router_score_function == "sigmoid" else self.moe_gate

    def wgrad_policy(self, expert_parallel_size: int) -> str:
        """--overlap-wgrad in force: off without an all-to-all to hide under (EP=1, megatron-core's layer)."""
        return self.overlap_wgrad if self.own_layer and expert_parallel_size > 1 else "off"

    def layer_pattern(self, num_layers: int) -> list[int]:
        """1 for an MoE layer, 0 for a dense one, per layer (Megatron-LM's moe_freq_type, evaluated safely)."""
        text = "".join(self.moe_layer_freq.split())
        if "[" in text:
            pattern = eval_layer_pattern(text)
            require(
                pattern is not None and len(pattern) == num_layers and set(pattern) <= {0, 1},
                "--moe-layer-freq",
                text,
                f"a list (or list expression) of {num_layers} zeros and ones (--num-layers), e.g. "
                f"([0]+[1]*{num_layers - 1})",
            )
            return pattern
        require(text.isdigit() and int(text) > 0, "--moe-layer-freq", text, "a positive integer or a 0/1 list")
        return [1 if i % int(text) == 0 else 0 for i in range(num_layers)]

    def moe_layer_count(self, model: ModelConfig) -> int:
        """MoE layers in the whole model: the decoder's (`layer_pattern`) and the MTP layers', whose transformer
        layer is the decoder's last layer's spec (MoE where the last layer is)."""
        if not self.is_moe:
            return 0
        pattern = self.layer_pattern(model.num_layers)
        return sum(pattern) + pattern[-1] * model.mtp_layers

    def layer_config(self, model: ModelConfig, seed: int | None = None) -> MoELayerConfig:
        """Our MoE layer's config from the run's flags (`seed`: --seed, for the experts' initial weights; None where
        the layer is only measured or checked): each layer flag's value as parsed, the model's widths, and the
        four settings Megatron-LM spells with other flags (the score function picks the gate; pre-softmax turns
        normalising off; groups count only with a group top-k; an unset z-loss is 0)."""
        flags = {f.name: getattr(self, flag_attribute(f)) for f in dataclasses.fields(MoELayerConfig) if is_flag(f)}
        return MoELayerConfig(
            **flags
            | {
                "gate": self.gate,
                "normalize_topk": self.topk_normalized,
                "num_groups": self.moe_router_num_groups if self.moe_router_group_topk else None,
                "z_loss_coeff": self.moe_z_loss_coeff or 0.0,
            },
            **({} if seed is None else {"init_seed": seed}),
            num_experts=self.num_experts,
            hidden_size=model.hidden_size,
            ffn_hidden_size=self.expert_ffn_width(model),
            expert_type="swiglu" if model.swiglu else "gelu",
            init_method_std=model.init_method_std,
        )

    def logged_router_losses(self, model: ModelConfig) -> tuple[bool, bool]:
        """(balancing loss, z-loss): whether the MoE layers compute each, so the log shows it (not a 0)."""
        if not self.is_moe:
            return False, False
        if self.own_layer:
            layer = self.layer_config(model)
            return layer.has_balancing_loss, layer.has_z_loss
        # megatron-core computes (and tracks) a balancing loss only with a positive coefficient.
        balancing = self.moe_router_load_balancing_type not in ("none", "sinkhorn") and self.moe_aux_loss_coeff > 0
        return balancing, bool(self.moe_z_loss_coeff)


MoEConfig = dataclasses.make_dataclass(
    "MoEConfig",
    flag_fields(MoELayerConfig),
    bases=(MoERunFlags,),
    kw_only=True,
    namespace={"__module__": __name__, "__doc__": MoERunFlags.__doc__},
)
"""The MoE flag group: `MoERunFlags` and one flag per `MoELayerConfig` setting (its declaration, named by its flag)."""


_LIST_OPS = {ast.Add: operator.add, ast.Mult: operator.mul}


def eval_layer_pattern(text: str) -> list | None:
    """Megatron-LM's --moe-layer-freq list expression (`([0]+[1]*2)`, `[1,0]*2`): lists of int literals joined
    by + and *, evaluated on the syntax tree (never `eval`); None when it is anything else or not a list."""

    def value(node):
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _LIST_OPS:
            left, right = value(node.left), value(node.right)
            sizes = [len(x) if isinstance(x, list) else abs(x) for x in (left, right)]
            if isinstance(node.op, ast.Mult) and sizes[0] * sizes[1] > 1 << 16:
                raise ValueError("too large")
            return _LIST_OPS[type(node.op)](left, right)
        raise ValueError(ast.dump(node))

    try:
        result = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
    return result if isinstance(result, list) and all(type(x) is int for x in result) else None
