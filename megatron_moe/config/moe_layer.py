"""The MoE layer's configuration, and the one declaration of every MoE layer flag.

`MoELayerConfig` is one keyword-only dataclass: a field declared with `arg(default, help, flag=, applies=,
parse=)` is a run flag as well (`groups.MoEConfig` is generated from these fields: `fields.flag_fields`), so a
layer setting has one declaration (type, default, help, when it applies) and one use. `validate()` names the
flag, the bad value and a valid choice; what a feature cannot run with is its blocker (`features.py`).
Pure Python (no torch): the run config builds and checks it without importing the layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_moe.config import conditions as only
from megatron_moe.config import features
from megatron_moe.config.fields import ConfigError, arg, flag_name
from megatron_moe.config.gate_traits import GATE_TRAITS, GATES

DROP_POLICIES = ("probs", "position")
"""Megatron-LM's --moe-token-drop-policy: which pairs an over-full expert keeps (the highest weights, or the
earliest tokens); unset, the gate's own claim order."""
ORDERINGS = ("sparse", "dense")
EXPERT_TYPES = ("gelu", "swiglu")
LOAD_BALANCING = ("aux_loss", "top1_aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
"""Our layer's --moe-router-load-balancing-type choices (seq_aux_loss, global_aux_loss: megatron-core's per-sequence
and global-batch losses)."""
FORCE_BALANCE_GATES = ("topk", "noisy_topk", "switch", "bpr", "rts", "sigmoid")
"""The gates whose logits --moe-router-force-load-balancing replaces (a linear router, softmax or sigmoid)."""
AUTO = "auto"
"""A pipeline degree the training set-up chooses (the cost model's solver)."""
A2A_ALGORITHMS = ("linear", "2dh", AUTO)
"""--moe-a2a-algorithm: the dispatch/combine all-to-all's transport (comm/hierarchy.py)."""


class MoEConfigError(ConfigError):
    """A MoE setting that cannot work; the message names the flag, its value and a valid choice.

    A `ConfigError`, so `pretrain_gpt_moe.py` reports it like any bad flag."""


def parse_degree(text: str | int) -> int | str:
    """A pipeline degree flag's value: "auto", or the integer it spells (left as given when it spells none, for
    `validate()` to name)."""
    if isinstance(text, str) and text.strip().lstrip("-").isdigit():
        return int(text)
    return text


def parse_shadow(text: str | int) -> int | str:
    """--moe-shadow-experts: "off", "auto", or the integer it spells (0: off; left as given when it spells none,
    for `validate()` to name)."""
    value = parse_degree(text.strip().lower() if isinstance(text, str) else text)
    return "off" if value == 0 else value


def group_limited_error(num_experts, topk, num_groups, group_topk, error=ConfigError) -> None:
    """Raise `error` naming the flag when group-limited routing cannot work (megatron-core's rules, and the two it
    leaves to chance: a group's score needs topk // group_topk >= 1 experts, the chosen groups >= topk experts)."""
    if group_topk is None:
        return
    choice = "e.g. --moe-router-num-groups 8 --moe-router-group-topk 4 for 64 experts and top-8"
    if not num_groups:
        raise error(f"--moe-router-group-topk={group_topk}: needs --moe-router-num-groups ({choice})")
    if num_groups <= 0 or num_experts % num_groups:
        raise error(f"--moe-router-num-groups={num_groups}: must divide --num-experts={num_experts} ({choice})")
    if not 1 <= group_topk <= min(num_groups, topk):
        raise error(
            f"--moe-router-group-topk={group_topk}: must be between 1 and --moe-router-num-groups={num_groups} "
            f"and at most --moe-router-topk={topk} ({choice})"
        )
    if group_topk * (num_experts // num_groups) < topk:
        raise error(
            f"--moe-router-group-topk={group_topk}: {group_topk} groups of {num_experts // num_groups} experts "
            f"hold fewer than --moe-router-topk={topk}; choose at least {-(-topk // (num_experts // num_groups))}"
        )


def _flag(flag: str, default: Any = dataclasses.MISSING):
    """A field set by the run flag `flag` (named in validation errors)."""
    return dataclasses.field(default=default, metadata={"flag": flag})


@dataclasses.dataclass(kw_only=True)
class MoELayerConfig:
    """How one MoE layer routes, lays out, moves and computes tokens. A field declared with `arg` is also the run
    flag it names (help: the flag's; docstring: the layer's meaning)."""

    num_experts: int
    """Experts in the layer, over all expert-parallel ranks (--num-experts)."""
    hidden_size: int
    """Model width H."""
    ffn_hidden_size: int = _flag("--moe-ffn-hidden-size")
    """Width F of one routed expert's MLP."""
    topk: int = arg(2, "experts per token", flag="--moe-router-topk", applies=only.TOKEN_PICKING)
    """Experts per token (token-choice gates); for expert-choice, the average experts per token."""
    load_balancing: str = arg(
        "aux_loss",
        "balancing loss E x sum_e f_e x P_e (f_e: share of routed choices on expert e, P_e: its mean router "
        "probability): aux_loss (all k choices counted), top1_aux_loss (the first choice only, GShard), "
        "seq_aux_loss (the loss per sequence, averaged over the sequences; DeepSeek-V2/V3), global_aux_loss (f_e "
        "over the global batch so far: the TP x DP x CP ranks' micro-batches of the step, megatron-core's), sinkhorn "
        "(no loss: the experts are chosen on Sinkhorn-balanced scores, megatron-core's; the sinkhorn gate), none",
        flag="--moe-router-load-balancing-type",
        choices=LOAD_BALANCING,
        applies=only.BALANCING_TYPE,
    )
    """Balancing loss E * sum_e f_e * P_e, one of `LOAD_BALANCING`: aux_loss (f_e counts all k
    choices, Switch/Megatron), top1_aux_loss (f_e counts the first choice only, GShard), seq_aux_loss (aux_loss per
    sequence, averaged over the sequences: DeepSeek-V2/V3, megatron-core's formula), global_aux_loss (f_e of the
    step's micro-batches so far over the TP x DP x CP ranks, P_e this rank's: megatron-core's, computed only with a
    positive coefficient), sinkhorn (the sinkhorn gate's choice, no loss), none."""
    aux_loss_coeff: float = arg(
        0.0,
        "load-balancing loss weight (Megatron-LM's default 0: the loss is still computed and logged in our layer, "
        "except global_aux_loss, but not weighted)",
        flag="--moe-aux-loss-coeff",
        applies=only.BALANCING,
    )
    """Weight of the balancing loss in the backward pass (0, Megatron-LM's default: logged, not weighted)."""
    z_loss_coeff: float = arg(
        0.0, "router z-loss weight (unset: off)", flag="--moe-z-loss-coeff", applies=only.Z_LOSS, flag_default=None
    )
    """Weight of the router z-loss (0: off)."""
    capacity_factor: float | None = arg(
        None,
        "Tutel semantics: > 0 fixed (drop overflow), 0 or unset dropless, < 0 dropless capped at |f|; "
        "C = ceil(|f| x topk x tokens / experts) per expert per EP rank",
        flag="--moe-expert-capacity-factor",
        applies=only.MOE,
    )
    """Tutel semantics: > 0 fixed factor (drop overflow); 0 or None dropless;
    < 0 adaptive (dropless, capped at |f|). Must stay None for expert_choice and soft."""
    pad_expert_input_to_capacity: bool = arg(
        False,
        "pad every expert's rows from every EP rank to the capacity C (the experts run one batched GEMM); "
        "without a capacity factor (dropless) C is the step's largest count over the EP group",
        flag="--moe-pad-expert-input-to-capacity",
        applies=only.PADDING,
    )
    """EP all-to-all: False sends exactly the kept rows (counts exchanged first); True pads every
    expert's rows from every rank to one capacity C (the factor's, or, dropless, the step's largest
    count over the EP group), so the experts run one batched GEMM."""
    gate: str = arg("topk", "routing function", flag="--moe-gate", choices=GATES, applies=only.OUR_MOE)
    """Routing function, one of `GATES` (a row of `gate_traits.GATE_TRAITS` each)."""
    ordering: str = arg(
        "sparse",
        "token layout: sparse (index gather/scatter) or dense (GShard einsum, always padded to capacity)",
        flag="--moe-ordering",
        choices=ORDERINGS,
        applies=only.OUR_MOE,
    )
    """Token layout transform: sparse (index gather/scatter, Tutel) or dense (GShard one-hot einsum)."""
    shared_expert_ffn_hidden_size: int | None = arg(
        None,
        "width of a dense MLP beside the experts (unset: none)",
        flag="--moe-shared-expert-ffn-hidden-size",
        applies=only.MOE,
    )
    """Width of a dense MLP beside the routed experts whose output is added (None: none); megatron-core's
    SharedExpertMLP under --moe-layer-impl mcore (never dropped)."""
    shared_expert_gate: bool = arg(
        False,
        "scale the shared expert's output by sigmoid(x . g), g a learned [1, H] (Qwen2-MoE)",
        flag="--moe-shared-expert-gate",
        applies=only.SHARED_EXPERT,
    )
    """Qwen2-MoE's gate on the shared expert: its output times sigmoid(x @ gate_weight^T), megatron-core's
    SharedExpertMLP arithmetic and parameter name (`gate_weight`, [1, H])."""
    pipeline_degree: int | str = arg(
        1,
        "FSMoE's pipeline: the dispatched rows in this many chunks in forward, chunk i's experts running while "
        "chunk i+1's all-to-all is in flight; an integer >= 1 (1: not pipelined) or auto (the cost model's choice "
        "from the cluster's profile, --moe-cost-profile; 1 where EP = ESP = 1)",
        flag="--moe-pipeline-degree",
        parse=parse_degree,
        flag_default=AUTO,
        applies=only.OUR_MOE,
    )
    """Forward chunks r_f of the dispatch -> experts -> combine pipeline (`megatron_moe.moe.pipeline`): an int
    >= 1 (1: not pipelined) or "auto" (the training set-up's choice; 1 until one is made)."""
    bp_pipeline_degree: int | str = arg(
        1,
        "the pipeline's chunks in backward (its own schedule): an integer >= 1 or auto",
        flag="--moe-bp-pipeline-degree",
        parse=parse_degree,
        flag_default=AUTO,
        applies=only.OUR_MOE,
    )
    """Backward chunks r_b of the pipeline, its own schedule: an int >= 1 or "auto"."""
    shadow_experts: int | str = arg(
        "off",
        "FasterMoE's shadow experts: per MoE layer and forward, the hottest experts' weights are broadcast to every "
        "EP rank, which computes its own rows for them, and their gradients are reduced to the owner; auto (the cost "
        "model's greedy choice from the agreed counts, FasterMoE's policy), off, or N (always the N most loaded). "
        "Dropless, EP > 1, built-in unsharded experts",
        flag="--moe-shadow-experts",
        parse=parse_shadow,
        applies=only.OUR_MOE,
    )
    """FasterMoE's shadow experts (`megatron_moe.moe.shadow`): "off", "auto" (the cost model's greedy choice per
    layer and forward; nothing until the training set-up gives the layer its costs) or N (the N most loaded).
    What blocks it: `features.shadow_blocker`."""
    a2a_algorithm: str = arg(
        "linear",
        "the dispatch/combine all-to-all: linear (one message per rank pair), 2dh (Tutel's two-dimensional "
        "hierarchical all-to-all: the node's ranks exchange first, then one message per rank of each other node "
        "on the same local index, bit-identical results; needs an EP group over several nodes with the same "
        "ranks on each, LOCAL_WORLD_SIZE) or auto (2dh where the cost model with per-message costs predicts it "
        "faster, said at start-up)",
        flag="--moe-a2a-algorithm",
        choices=A2A_ALGORITHMS,
        applies=only.EXPERT_PARALLEL,
    )
    """The dispatch/combine all-to-all: linear, 2dh (comm/hierarchy.py: the EP group's groups made at start-up) or
    auto (2dh where the start-up's cost model chose it and made the groups, else linear). The same rows either way."""
    normalize_topk: bool = arg(
        True, "rescale the k chosen gate scores to sum to 1", flag="--moe-normalize-topk", applies=only.NORMALIZING
    )
    """Rescale the k chosen gate scores to sum to 1 (GShard) when k > 1."""
    topk_scaling_factor: float | None = arg(
        None,
        "multiply the k combine weights by this (DeepSeek-V3: 2.5)",
        flag="--moe-router-topk-scaling-factor",
        applies=only.TOKEN_CHOICE,
    )
    """Multiply the k combine weights by this after normalising (Megatron-LM, DeepSeek-V3's 2.5; None: 1)."""
    expert_bias: bool = arg(
        False,
        "DeepSeek-V3's aux-loss-free balancing: a per-layer expert bias (fp32, replicated, checkpointed) added to "
        "the sigmoid scores only to choose the top-k (the combine weights stay unbiased); after each step every "
        "bias moves by --moe-router-bias-update-rate toward the mean load (the step's tokens per expert summed "
        "over the TP x CP x DP ranks). Needs --moe-router-score-function sigmoid and, in our layer, no capacity",
        flag="--moe-router-enable-expert-bias",
        applies=only.MOE,
    )
    """Aux-loss-free balancing (DeepSeek-V3): an fp32 bias per expert added to the scores only to choose the top-k,
    moved after each step toward the mean load (`megatron_moe.moe.expert_bias`). Sigmoid gate, dropless."""
    force_load_balancing: bool = arg(
        False,
        "benchmarks only: the router's logits replaced by random ones (megatron-core's RandomSTE), loads balanced "
        "in expectation; the model learns nothing useful",
        flag="--moe-router-force-load-balancing",
        applies=only.MOE,
    )
    """Megatron-LM's --moe-router-force-load-balancing: N(0, 1) logits, gradient straight through (softmax and
    sigmoid gates; megatron-core's layer does the same)."""
    force_biased: float | None = arg(
        None,
        "benchmarks only: the router's logits replaced by random ones plus a random bias per expert, N(0, |STD|) "
        "and the same on every rank, so the load is skewed (Megatron-LM's, after megatron-core 0.16.1): STD > 0 "
        "a new bias each forward, STD < 0 one bias per layer for the run; the model learns nothing useful",
        flag="--moe-router-force-biased",
        applies=only.MOE,
    )
    """Megatron-LM's --moe-router-force-biased (`megatron_moe.moe.routing.ForcedBias`); megatron-core 0.16.1's
    layer has no such option, so with --moe-layer-impl mcore it is refused (rules.py)."""
    bias_update_rate: float = arg(
        1e-3,
        "the expert bias's step: bias += rate x sign(mean load - load)",
        flag="--moe-router-bias-update-rate",
        applies=only.EXPERT_BIAS,
    )
    """The bias's step per training step: bias += rate * sign(mean load - load)."""
    num_groups: int | None = arg(
        None,
        "group-limited routing: the experts in this many equal groups (device-limited: EP; node-limited: nodes)",
        flag="--moe-router-num-groups",
        applies=only.GROUP_LIMITED,
    )
    """Group-limited routing: the experts in this many equal groups (None: off)."""
    group_topk: int | None = arg(
        None,
        "group-limited routing: each token's top-k among the experts of its best this-many groups (a group's "
        "score: the sum of its top topk/group-topk scores); needs --moe-router-num-groups",
        flag="--moe-router-group-topk",
        applies=only.GROUP_TOPK,
    )
    """Group-limited routing: groups each token may use, ranked by the sum of their top topk/group_topk scores."""
    drop_policy: str | None = arg(
        None,
        "over capacity, which pairs an expert keeps: probs (the highest weights) or position (the earliest "
        "tokens), as Megatron-LM; unset: the gate's claim order (k-major, every first choice before any second)",
        flag="--moe-token-drop-policy",
        choices=DROP_POLICIES,
        applies=only.DROPPING,
    )
    """Over capacity, which pairs an expert keeps, one of `DROP_POLICIES`; None: the gate's claim order."""
    router_dim: int | None = arg(
        None,
        "projection width of the xmoe/cosine gates (default 16 / 256)",
        flag="--moe-router-dim",
        applies=only.PROJECTING,
    )
    """Projection width of the xmoe/cosine gates (default 16 for xmoe, 256 for cosine)."""
    soft_slots: int = arg(1, "slots per expert of --moe-gate soft", flag="--moe-soft-slots", applies=only.SOFT)
    """Slots per expert of the soft gate."""
    expert_type: str = _flag("--swiglu", "gelu")
    """Built-in experts: gelu (GPT FFN) or swiglu (Mixtral)."""
    init_method_std: float = 0.02
    """Std of the normal init of router and expert weights (output projections scaled by the caller)."""
    init_seed: int = _flag("--seed", 1234)
    """Seed of the routed experts' initial weights: expert e of layer l starts from (init_seed, l, e) alone."""

    @property
    def gated(self) -> bool:
        return self.expert_type == "swiglu"

    @property
    def dispatcher(self) -> str:
        """The dispatcher `build_dispatcher` builds: padded_alltoall (capacity-padded) or alltoallv (exact rows)."""
        return "padded_alltoall" if self.pad_expert_input_to_capacity else "alltoallv"

    @property
    def has_balancing_loss(self) -> bool:
        """Whether the gate computes a balancing loss (what the log shows as `moe aux loss`)."""
        no_loss = self.load_balancing in ("none", "sinkhorn") or self.gate == "sinkhorn"  # sinkhorn balances by choice
        unweighted = self.load_balancing == "global_aux_loss" and self.aux_loss_coeff == 0  # megatron-core: none
        return not (no_loss or unweighted or GATE_TRAITS[self.gate].balanced)

    @property
    def has_z_loss(self) -> bool:
        """Whether the gate computes a z-loss (the soft gate has no router logits to penalise)."""
        return self.z_loss_coeff > 0 and GATE_TRAITS[self.gate].router_logits

    def flag(self, field: str) -> str:
        """The run flag that sets `field`."""
        return flag_name(next(f for f in dataclasses.fields(self) if f.name == field))

    def _require(self, condition: bool, field: str, expected: str) -> None:
        if not condition:
            raise MoEConfigError(f"{self.flag(field)}={getattr(self, field)}: {expected}")

    def validate(self, ep_size: int | None = None, esp_size: int | None = None) -> MoELayerConfig:
        """Check every field, and every feature asked for explicitly against its blocker (`features.py`) at the EP
        and ESP sizes where known (None: not yet); returns self so a spec can validate inline."""
        r = self._require
        r(self.num_experts > 0, "num_experts", "must be positive")
        r(self.gate in GATE_TRAITS, "gate", f"choose one of {', '.join(GATE_TRAITS)}")
        r(self.ordering in ORDERINGS, "ordering", f"choose one of {', '.join(ORDERINGS)}")
        r(self.expert_type in EXPERT_TYPES, "expert_type", f"choose one of {', '.join(EXPERT_TYPES)}")
        r(
            self.load_balancing in LOAD_BALANCING,
            "load_balancing",
            f"megatron_moe's layer implements {', '.join(LOAD_BALANCING)}",
        )
        r(1 <= self.topk <= self.num_experts, "topk", f"must be between 1 and --num-experts={self.num_experts}")
        traits = GATE_TRAITS[self.gate]
        if traits.single_expert:
            r(self.topk == 1, "topk", "--moe-gate=switch routes each token to 1 expert; use 1")
        if self.drop_policy is not None:
            r(self.drop_policy in DROP_POLICIES, "drop_policy", f"choose one of {', '.join(DROP_POLICIES)}")
            r(
                not traits.own_order,
                "drop_policy",
                f"--moe-gate={self.gate} orders its claims itself; leave --moe-token-drop-policy unset",
            )
        r(
            self.topk_scaling_factor is None or self.topk_scaling_factor > 0,
            "topk_scaling_factor",
            "must be > 0, e.g. 2.5",
        )
        if self.expert_bias:
            r(
                self.gate == "sigmoid",
                "expert_bias",
                f"biases sigmoid scores only, as megatron-core (not --moe-gate={self.gate}); add "
                "--moe-router-score-function sigmoid",
            )
            r(
                not self.capacity_factor,
                "capacity_factor",
                "the expert bias counts every routed pair (dropless); leave the capacity factor unset with "
                "--moe-router-enable-expert-bias",
            )
        r(self.bias_update_rate >= 0, "bias_update_rate", "must be >= 0, e.g. 1e-3")
        if self.group_topk is not None:
            r(
                traits.group_limited,
                "group_topk",
                f"group-limited routing needs a top-k gate: --moe-gate topk or sigmoid, not {self.gate}",
            )
        group_limited_error(self.num_experts, self.topk, self.num_groups, self.group_topk, MoEConfigError)
        if traits.balanced:
            r(
                self.capacity_factor is None,
                "capacity_factor",
                f"--moe-gate={self.gate} fixes each expert's load itself; leave the capacity factor unset",
            )
        known_ep, known_esp = ep_size, esp_size
        ep_size, esp_size = ep_size or 1, esp_size or 1
        r(self.num_experts % ep_size == 0, "num_experts", f"must be a multiple of the expert-parallel size {ep_size}")
        r(self.hidden_size > 0 and self.ffn_hidden_size > 0, "ffn_hidden_size", "hidden and ffn sizes must be positive")
        r(
            self.ffn_hidden_size % esp_size == 0,
            "ffn_hidden_size",
            f"must be a multiple of --expert-tensor-parallel-size={esp_size} (each expert's width is split over "
            f"it), e.g. {esp_size * max(1, self.ffn_hidden_size // esp_size)}",
        )
        for forced in ("force_load_balancing", "force_biased"):
            r(
                getattr(self, forced) in (False, None) or self.gate in FORCE_BALANCE_GATES,
                forced,
                f"--moe-gate={self.gate} has no router logits to replace; use one of {', '.join(FORCE_BALANCE_GATES)}",
            )
        r(self.force_biased != 0, "force_biased", "a standard deviation: > 0 (a new bias each step) or < 0 (one bias)")
        r(
            not self.shared_expert_gate or bool(self.shared_expert_ffn_hidden_size),
            "shared_expert_gate",
            "gates a shared expert: give --moe-shared-expert-ffn-hidden-size (e.g. 1024) or drop it",
        )
        if self.shared_expert_ffn_hidden_size is not None:
            r(
                self.shared_expert_ffn_hidden_size > 0,
                "shared_expert_ffn_hidden_size",
                "must be positive (or unset for no shared expert)",
            )
        r(self.aux_loss_coeff >= 0, "aux_loss_coeff", "must be >= 0")
        r(self.z_loss_coeff >= 0, "z_loss_coeff", "must be >= 0")
        r(self.router_dim is None or self.router_dim > 0, "router_dim", "must be positive")
        r(self.soft_slots > 0, "soft_slots", "must be positive")
        for field in ("pipeline_degree", "bp_pipeline_degree"):
            value = getattr(self, field)
            r(value == AUTO or (type(value) is int and value >= 1), field, f'"{AUTO}" or an integer >= 1, e.g. 2')
        r(self.a2a_algorithm in A2A_ALGORITHMS, "a2a_algorithm", f"choose one of {', '.join(A2A_ALGORITHMS)}")
        shadow = self.shadow_experts
        r(shadow in ("off", AUTO) or (type(shadow) is int and shadow >= 1), "shadow_experts", "off, auto or N >= 1")
        if features.explicit(shadow):
            r(shadow <= self.num_experts, "shadow_experts", f"at most --num-experts={self.num_experts}")
        features.refuse_blocked(self, ep_size=known_ep, esp_size=known_esp, error=MoEConfigError)
        return self
