"""The MoE layer's own configuration: one keyword-only dataclass, checked by `validate()`.

Each field maps to one `--moe-*` flag of the run (see `FLAGS`); `validate()`
names the flag, the bad value and a valid choice, like the run config does.
"""

from __future__ import annotations

import dataclasses

from megatron_moe.config.fields import ConfigError

GATES = ("topk", "noisy_topk", "switch", "sigmoid", "xmoe", "cosine", "expert_choice", "soft", "bpr", "rts")
ORDERINGS = ("sparse", "dense")
DISPATCHERS = ("alltoallv", "alltoall")
EXPERT_TYPES = ("gelu", "swiglu")
LOAD_BALANCING = ("switch", "gshard", "none")

# Field -> the run flag that sets it (for error messages and the lead's CLI).
FLAGS = {
    "num_experts": "--num-experts",
    "topk": "--moe-router-topk",
    "gate": "--moe-gate",
    "capacity_factor": "--moe-capacity-factor",
    "ordering": "--moe-ordering",
    "dispatcher": "--moe-dispatcher",
    "expert_type": "--swiglu",
    "ffn_hidden_size": "--moe-ffn-hidden-size",
    "shared_expert_ffn_hidden_size": "--moe-shared-expert-ffn-hidden-size",
    "load_balancing": "--moe-load-balancing",
    "aux_loss_coeff": "--moe-aux-loss-coeff",
    "z_loss_coeff": "--moe-z-loss-coeff",
    "normalize_topk": "--moe-normalize-topk",
    "router_dim": "--moe-router-dim",
    "soft_slots": "--moe-soft-slots",
}


class MoEConfigError(ConfigError):
    """A MoE setting that cannot work; the message names the flag, its value and a valid choice.

    A `ConfigError`, so `pretrain_gpt_moe.py` reports it like any bad flag."""


def _require(condition: bool, field: str, value, expected: str) -> None:
    if not condition:
        raise MoEConfigError(f"{FLAGS.get(field, field)}={value}: {expected}")


@dataclasses.dataclass(kw_only=True)
class MoELayerConfig:
    """How one MoE layer routes, lays out, moves and computes tokens."""

    num_experts: int
    """Experts in the layer, over all expert-parallel ranks."""
    hidden_size: int
    """Model width H."""
    ffn_hidden_size: int
    """Width F of one routed expert's MLP."""
    topk: int = 2
    """Experts per token (token-choice gates); for expert-choice, the average experts per token."""
    gate: str = "topk"
    """Routing function, one of `GATES`: topk (GShard softmax), noisy_topk (trainable noise),
    switch (top-1), sigmoid, xmoe (low-rank cosine, learnable temperature), cosine (Tutel),
    expert_choice, soft (SoftMoE slots), bpr (batch-prioritized), rts (random token selection)."""
    capacity_factor: float | None = None
    """Tutel semantics: > 0 fixed factor (pad to capacity, drop overflow); 0 or None dropless;
    < 0 adaptive (dropless, capped at |f|). Must stay None for expert_choice and soft."""
    ordering: str = "sparse"
    """Token layout transform: sparse (index gather/scatter, Tutel) or dense (GShard one-hot einsum)."""
    dispatcher: str = "alltoallv"
    """EP all-to-all: alltoallv (exchange counts, then exact rows) or alltoall (capacity-padded)."""
    expert_type: str = "gelu"
    """Built-in experts: gelu (GPT FFN) or swiglu (Mixtral)."""
    shared_expert_ffn_hidden_size: int | None = None
    """Width of a dense MLP beside the routed experts whose output is added (None: none)."""
    load_balancing: str = "switch"
    """Balancing loss: switch (all k choices counted), gshard (first choice counted), none."""
    aux_loss_coeff: float = 0.01
    """Weight of the balancing loss in the backward pass."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss (0: off)."""
    normalize_topk: bool = True
    """Rescale the k chosen gate scores to sum to 1 (GShard) when k > 1."""
    router_dim: int | None = None
    """Projection width of the xmoe/cosine gates (default 16 for xmoe, 256 for cosine)."""
    soft_slots: int = 1
    """Slots per expert of the soft gate."""
    init_method_std: float = 0.02
    """Std of the normal init of router and expert weights (output projections scaled by the caller)."""

    @property
    def is_dropless(self) -> bool:
        return self.capacity_factor is None or self.capacity_factor <= 0

    @property
    def gated(self) -> bool:
        return self.expert_type == "swiglu"

    def validate(self, ep_size: int = 1) -> "MoELayerConfig":
        """Check every field; returns self so a spec can validate inline."""
        _require(self.num_experts > 0, "num_experts", self.num_experts, "must be positive")
        _require(self.gate in GATES, "gate", self.gate, f"choose one of {', '.join(GATES)}")
        _require(self.ordering in ORDERINGS, "ordering", self.ordering, f"choose one of {', '.join(ORDERINGS)}")
        _require(self.dispatcher in DISPATCHERS, "dispatcher", self.dispatcher,
                 f"choose one of {', '.join(DISPATCHERS)}")  # fmt: skip
        _require(self.expert_type in EXPERT_TYPES, "expert_type", self.expert_type,
                 f"choose one of {', '.join(EXPERT_TYPES)}")  # fmt: skip
        _require(self.load_balancing in LOAD_BALANCING, "load_balancing", self.load_balancing,
                 f"choose one of {', '.join(LOAD_BALANCING)}")  # fmt: skip
        _require(1 <= self.topk <= self.num_experts, "topk", self.topk,
                 f"must be between 1 and --num-experts={self.num_experts}")  # fmt: skip
        if self.gate == "switch":
            _require(self.topk == 1, "topk", self.topk, "--moe-gate=switch routes each token to 1 expert; use 1")
        if self.gate in ("expert_choice", "soft"):
            _require(self.capacity_factor is None, "capacity_factor", self.capacity_factor,
                     f"--moe-gate={self.gate} fixes each expert's load itself; leave the capacity factor unset")  # fmt: skip
        _require(self.num_experts % ep_size == 0, "num_experts", self.num_experts,
                 f"must be a multiple of the expert-parallel size {ep_size}")  # fmt: skip
        _require(self.hidden_size > 0 and self.ffn_hidden_size > 0, "ffn_hidden_size", self.ffn_hidden_size,
                 "hidden and ffn sizes must be positive")  # fmt: skip
        if self.shared_expert_ffn_hidden_size is not None:
            _require(self.shared_expert_ffn_hidden_size > 0, "shared_expert_ffn_hidden_size",
                     self.shared_expert_ffn_hidden_size, "must be positive (or unset for no shared expert)")  # fmt: skip
        _require(self.aux_loss_coeff >= 0, "aux_loss_coeff", self.aux_loss_coeff, "must be >= 0")
        _require(self.z_loss_coeff >= 0, "z_loss_coeff", self.z_loss_coeff, "must be >= 0")
        _require(self.router_dim is None or self.router_dim > 0, "router_dim", self.router_dim, "must be positive")
        _require(self.soft_slots > 0, "soft_slots", self.soft_slots, "must be positive")
        return self
