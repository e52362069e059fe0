"""Multi-token prediction's flag checks (--mtp-num-layers, --mtp-loss-scaling-factor), run in the flag pass.

In: the RunConfig. Out: a ConfigError naming the flag, its value and a valid choice, before any process group
or model exists. What megatron-core 0.16.1 and Megatron-LM assert about MTP is checked here: a non-negative
layer count, RoPE positions (Megatron-LM's validate_args; the MTP layers' own embedding would need the
learned-position table on the last stage). Where MTP sits, what composes with it: docs/internals/config.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_moe.config.fields import require, require_non_negative

if TYPE_CHECKING:
    from megatron_moe.config import RunConfig


def check_mtp(cfg: RunConfig) -> None:
    """--mtp-num-layers >= 0 (0 or unset: none), its loss factor >= 0, and what MTP needs of the model."""
    m = cfg.model
    require_non_negative("--mtp-num-layers", m.mtp_num_layers, 1)
    require_non_negative("--mtp-loss-scaling-factor", m.mtp_loss_scaling_factor, 0.1)
    if not m.mtp_layers:
        return
    require(
        m.position_embedding_type == "rope",
        "--position-embedding-type",
        m.position_embedding_type,
        f"rope with --mtp-num-layers={m.mtp_num_layers} (Megatron-LM's multi-token prediction supports rope or "
        "none; its MTP layers re-embed the shifted tokens without the learned-position table)",
    )
