"""The MoE layer's own configuration: one keyword-only dataclass, checked by `validate()`.

It lives in the config layer (pure Python, no torch) so that the run config
can build and check it without importing the layer; `megatron_moe.moe`
imports it from here. Each field names the run flag that sets it (`flag`
metadata, or `--field-name`), so `validate()` names the flag, the bad value
and a valid choice, like the run config does. `MoEConfig.layer_config` in
groups.py is the one place that turns the run's flags into this config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_moe.config.fields import ConfigError, flag_name

GATES = ("topk", "noisy_topk", "switch", "sigmoid", "xmoe", "cosine", "expert_choice", "soft", "bpr", "rts")
DROP_POLICIES = ("probs", "position")
"""Megatron-LM's --moe-token-drop-policy: which pairs an over-full expert keeps (the highest weights, or the
earliest tokens); unset, the gate's own claim order."""
OWN_ORDER_GATES = ("bpr", "rts", *("expert_choice", "soft"))
"""Gates whose claim order is their definition (or who drop nothing): no --moe-token-drop-policy."""
BALANCED_GATES = ("expert_choice", "soft")
"""Gates that fix every expert's load themselves: no balancing loss, no capacity factor."""
ORDERINGS = ("sparse", "dense")
EXPERT_TYPES = ("gelu", "swiglu")
LOAD_BALANCING = ("aux_loss", "top1_aux_loss", "none")
"""Our layer's --moe-router-load-balancing-type choices (megatron-core's seq_aux_loss is not implemented)."""
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
    """How one MoE layer routes, lays out, moves and computes tokens."""

    num_experts: int
    """Experts in the layer, over all expert-parallel ranks."""
    hidden_size: int
    """Model width H."""
    ffn_hidden_size: int = _flag("--moe-ffn-hidden-size")
    """Width F of one routed expert's MLP."""
    topk: int = _flag("--moe-router-topk", 2)
    """Experts per token (token-choice gates); for expert-choice, the average experts per token."""
    gate: str = _flag("--moe-gate", "topk")
    """Routing function, one of `GATES`: topk (GShard softmax), noisy_topk (trainable noise),
    switch (top-1), sigmoid, xmoe (low-rank cosine, learnable temperature), cosine (Tutel),
    expert_choice, soft (SoftMoE slots), bpr (batch-prioritized), rts (random token selection)."""
    capacity_factor: float | None = _flag("--moe-expert-capacity-factor", None)
    """Tutel semantics: > 0 fixed factor (drop overflow); 0 or None dropless;
    < 0 adaptive (dropless, capped at |f|). Must stay None for expert_choice and soft."""
    ordering: str = _flag("--moe-ordering", "sparse")
    """Token layout transform: sparse (index gather/scatter, Tutel) or dense (GShard one-hot einsum)."""
    pad_expert_input_to_capacity: bool = _flag("--moe-pad-expert-input-to-capacity", False)
    """EP all-to-all: False sends exactly the kept rows (counts exchanged first); True pads every
    expert's rows from every rank to one capacity C (the factor's, or, dropless, the step's largest
    count over the EP group), so the experts run one batched GEMM."""
    expert_type: str = _flag("--swiglu", "gelu")
    """Built-in experts: gelu (GPT FFN) or swiglu (Mixtral)."""
    shared_expert_ffn_hidden_size: int | None = _flag("--moe-shared-expert-ffn-hidden-size", None)
    """Width of a dense MLP beside the routed experts whose output is added (None: none)."""
    load_balancing: str = _flag("--moe-router-load-balancing-type", "aux_loss")
    """Balancing loss E * sum_e f_e * P_e, one of `LOAD_BALANCING`: aux_loss (f_e counts all k
    choices, Switch/Megatron), top1_aux_loss (f_e counts the first choice only, GShard), none."""
    aux_loss_coeff: float = _flag("--moe-aux-loss-coeff", 0.01)
    """Weight of the balancing loss in the backward pass."""
    z_loss_coeff: float = _flag("--moe-z-loss-coeff", 0.0)
    """Weight of the router z-loss (0: off)."""
    normalize_topk: bool = _flag("--moe-normalize-topk", True)
    """Rescale the k chosen gate scores to sum to 1 (GShard) when k > 1."""
    topk_scaling_factor: float | None = _flag("--moe-router-topk-scaling-factor", None)
    """Multiply the k combine weights by this after normalising (Megatron-LM, DeepSeek-V3's 2.5; None: 1)."""
    expert_bias: bool = _flag("--moe-router-enable-expert-bias", False)
    """Aux-loss-free balancing (DeepSeek-V3): an fp32 bias per expert added to the scores only to choose the top-k,
    moved after each step toward the mean load (`megatron_moe.moe.expert_bias`). Sigmoid gate, dropless."""
    bias_update_rate: float = _flag("--moe-router-bias-update-rate", 1e-3)
    """The bias's step per training step: bias += rate * sign(mean load - load)."""
    num_groups: int | None = _flag("--moe-router-num-groups", None)
    """Group-limited routing: the experts in this many equal groups (None: off)."""
    group_topk: int | None = _flag("--moe-router-group-topk", None)
    """Group-limited routing: groups each token may use, ranked by the sum of their top topk/group_topk scores."""
    drop_policy: str | None = _flag("--moe-token-drop-policy", None)
    """Over capacity, which pairs an expert keeps, one of `DROP_POLICIES`: probs (the highest combine
    weights), position (the earliest tokens); None: the gate's claim order (k-major: every first choice
    before any second, GShard)."""
    router_dim: int | None = _flag("--moe-router-dim", None)
    """Projection width of the xmoe/cosine gates (default 16 for xmoe, 256 for cosine)."""
    soft_slots: int = _flag("--moe-soft-slots", 1)
    """Slots per expert of the soft gate."""
    pipeline_degree: int | str = _flag("--moe-pipeline-degree", 1)
    """Forward chunks r_f of the dispatch -> experts -> combine pipeline (`megatron_moe.moe.pipeline`): an int
    >= 1 (1: not pipelined) or "auto" (the training set-up's choice; 1 until one is made)."""
    bp_pipeline_degree: int | str = _flag("--moe-bp-pipeline-degree", 1)
    """Backward chunks r_b of the pipeline, its own schedule: an int >= 1 or "auto"."""
    shadow_experts: int | str = _flag("--moe-shadow-experts", "off")
    """FasterMoE's shadow experts (`megatron_moe.moe.shadow`): "off", "auto" (the cost model's greedy choice per
    layer and forward; nothing until the training set-up gives the layer its costs) or N (the N most loaded)."""
    a2a_algorithm: str = _flag("--moe-a2a-algorithm", "linear")
    """The dispatch/combine all-to-all: linear (one message per rank pair), 2dh (Tutel's two-dimensional
    hierarchical all-to-all, comm/hierarchy.py: the EP group's groups made at start-up) or auto (2dh where the
    start-up's cost model chose it and made the groups, else linear). The same rows either way."""
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
        return self.load_balancing != "none" and self.gate not in BALANCED_GATES

    @property
    def has_z_loss(self) -> bool:
        """Whether the gate computes a z-loss (the soft gate has no router logits to penalise)."""
        return self.z_loss_coeff > 0 and self.gate != "soft"

    def _require(self, condition: bool, field: str, expected: str) -> None:
        if not condition:
            spec = next(f for f in dataclasses.fields(self) if f.name == field)
            raise MoEConfigError(f"{flag_name(spec)}={getattr(self, field)}: {expected}")

    def validate(self, ep_size: int = 1, esp_size: int = 1) -> MoELayerConfig:
        """Check every field; returns self so a spec can validate inline."""
        r = self._require
        r(self.num_experts > 0, "num_experts", "must be positive")
        r(self.gate in GATES, "gate", f"choose one of {', '.join(GATES)}")
        r(self.ordering in ORDERINGS, "ordering", f"choose one of {', '.join(ORDERINGS)}")
        r(self.expert_type in EXPERT_TYPES, "expert_type", f"choose one of {', '.join(EXPERT_TYPES)}")
        r(
            self.load_balancing in LOAD_BALANCING,
            "load_balancing",
            f"megatron_moe's layer implements {', '.join(LOAD_BALANCING)} (seq_aux_loss only with "
            f"--moe-layer-impl mcore)",
        )
        r(1 <= self.topk <= self.num_experts, "topk", f"must be between 1 and --num-experts={self.num_experts}")
        if self.gate == "switch":
            r(self.topk == 1, "topk", "--moe-gate=switch routes each token to 1 expert; use 1")
        if self.drop_policy is not None:
            r(self.drop_policy in DROP_POLICIES, "drop_policy", f"choose one of {', '.join(DROP_POLICIES)}")
            r(
                self.gate not in OWN_ORDER_GATES,
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
                self.gate in ("topk", "sigmoid"),
                "group_topk",
                f"group-limited routing needs a top-k gate: --moe-gate topk or sigmoid, not {self.gate}",
            )
        group_limited_error(self.num_experts, self.topk, self.num_groups, self.group_topk, MoEConfigError)
        if self.gate in BALANCED_GATES:
            r(
                self.capacity_factor is None,
                "capacity_factor",
                f"--moe-gate={self.gate} fixes each expert's load itself; leave the capacity factor unset",
            )
        r(self.num_experts % ep_size == 0, "num_experts", f"must be a multiple of the expert-parallel size {ep_size}")
        r(self.hidden_size > 0 and self.ffn_hidden_size > 0, "ffn_hidden_size", "hidden and ffn sizes must be positive")
        r(
            self.ffn_hidden_size % esp_size == 0,
            "ffn_hidden_size",
            f"must be a multiple of --expert-tensor-parallel-size={esp_size} (each expert's width is split over "
            f"it), e.g. {esp_size * max(1, self.ffn_hidden_size // esp_size)}",
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
        if type(shadow) is int:  # asked for by number, what cannot shadow is an error (auto: off, said in the log);
            # EP = 1 and ESP: the layer (MoELayer._shadow_blocker), and the run's flags before start-up (rules.py)
            r(shadow <= self.num_experts, "shadow_experts", f"at most --num-experts={self.num_experts}")
            r(
                not self.pad_expert_input_to_capacity and self.capacity_factor is None,
                "shadow_experts",
                "off: shadowing is dropless only (a shadowed expert's rows would escape its capacity); unset "
                "--moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity",
            )
            r(self.gate not in BALANCED_GATES, "shadow_experts", f"off: --moe-gate={self.gate} fixes every load")
        return self
