"""What keeps an MoE feature from running: one blocker per feature, from the flags and the layout's sizes.

`BLOCKERS[field](cfg, ep_size=, esp_size=)` -> a `Blocked` (what to set instead, and why) or None, for a
`MoELayerConfig` field that names an optional feature. Flag validation turns a block into an error naming the
flag for an explicit value (`refuse_blocked`); `auto` turns it into one logged reason (the layer's note). What
only the built layer knows (custom experts, hooks, the activation policy) is the layer's own runtime blocker.
Invariant: every rank computes the same answer from the same flags and sizes (no measured figure).
"""

from __future__ import annotations

import typing
from collections.abc import Callable

from megatron_moe.config.gate_traits import GATE_TRAITS

if typing.TYPE_CHECKING:
    from megatron_moe.config.moe_layer import MoELayerConfig


class Blocked(typing.NamedTuple):
    """Why a feature cannot run, and the flag values that can."""

    valid: str
    """The values of the feature's flag that run here, e.g. "off or auto"."""
    why: str

    def __str__(self) -> str:
        return self.why


def shadow_blocker(cfg: MoELayerConfig, *, ep_size: int | None, esp_size: int | None) -> Blocked | None:
    """--moe-shadow-experts: FasterMoE's shadow experts need other EP ranks, unsharded weights, exact rows (a size
    None: not known yet, e.g. a layer spec built before the process groups)."""
    sharded = esp_size is not None and esp_size > 1
    if ep_size == 1 or sharded:
        return Blocked(
            "off or auto",
            "shadowing needs --expert-model-parallel-size > 1 (one EP rank has every expert) and unsharded experts "
            "(--expert-tensor-parallel-size 1"
            + ("; expert-sharded experts are sliced over their ESP group)" if sharded else ")"),
        )
    if cfg.pad_expert_input_to_capacity or cfg.capacity_factor is not None:
        return Blocked(
            "off",
            "shadowing is dropless only (a shadowed expert's rows would escape its capacity); unset "
            "--moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity",
        )
    if GATE_TRAITS[cfg.gate].balanced:
        return Blocked("off", f"--moe-gate={cfg.gate} fixes every load")
    return None


Blocker = Callable[..., Blocked | None]
BLOCKERS: dict[str, Blocker] = {"shadow_experts": shadow_blocker}
"""`MoELayerConfig` field -> its feature's blocker. Adding a feature: its field and its row here."""


def explicit(value) -> bool:
    """A value that asks for the feature by number (not "off", not "auto")."""
    return type(value) is int


def refuse_blocked(cfg: MoELayerConfig, *, ep_size: int | None, esp_size: int | None, error: type[Exception]) -> None:
    """Raise `error` naming the flag for each feature asked for explicitly that its blocker refuses."""
    for field, blocker in BLOCKERS.items():
        value = getattr(cfg, field)
        if explicit(value) and (blocked := blocker(cfg, ep_size=ep_size, esp_size=esp_size)) is not None:
            raise error(f"{cfg.flag(field)}={value}: {blocked.valid}: {blocked.why}")
