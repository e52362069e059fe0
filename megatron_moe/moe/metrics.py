"""Per-layer MoE statistics for the log, and the router losses' gradient scale.

No module-level state: each `MoELayer` owns an `MoEStats` (detached sums
over the step) and an `aux_loss_scale`; the training loop sets the scale with
`set_moe_aux_loss_scale` and reads the figures with `collect_moe_metrics`. The
router losses' gradient path itself: `megatron_moe.moe.aux_loss`.

Legend: E = experts; per-layer figures cover every layer of the model (all pipeline stages).
"""

from __future__ import annotations

import math

import torch

from megatron_moe import comm
from megatron_moe.platform import current_platform, table_to_host

# Per-layer statistics row: E routed counts, then these scalars.
SCALARS = ("dropped", "pairs", "tokens", "entropy_sum", "load_balancing_sum", "z_loss_sum", "calls")
PER_LAYER = (
    "tokens_min",
    "tokens_max",
    "tokens_cv",
    "dropped_fraction",
    "dead_experts",
    "router_entropy",
    "aux_loss",
    "z_loss",
)


class MoEStats:
    """Detached running sums of one layer's routing over a step (reset by `collect_moe_metrics`)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.sums: torch.Tensor | None = None

    def record(
        self,
        *,
        routed_E: torch.Tensor,
        dropped: int,
        tokens: int | torch.Tensor,
        entropy_sum: torch.Tensor,
        losses: dict[str, torch.Tensor],
    ) -> None:
        """`tokens`: a count on the host, or on the device (tokens not padding): never read here."""
        device = routed_E.device
        zero = torch.zeros((), device=device)
        tokens = tokens.float() if torch.is_tensor(tokens) else torch.full((), float(tokens), device=device)
        scalars = torch.stack(
            [
                torch.full((), float(dropped), device=device),
                routed_E.sum().float(),  # fills, not host copies
                tokens,
                entropy_sum.float(),
                losses.get("load_balancing", zero).float(),
                losses.get("z_loss", zero).float(),
                torch.ones((), device=device),
            ]
        )
        row = torch.cat([routed_E.double(), scalars.double()])
        self.sums = row if self.sums is None else self.sums + row

    def reset(self) -> None:
        self.sums = None


def moe_layer_modules(model_chunks):
    """Our MoE layers in `model_chunks`, in model order: the modules that record MoEStats (layer.py imports this
    module, not back)."""
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(getattr(module, "stats", None), MoEStats):
                yield module


def set_moe_aux_loss_scale(model_chunks, scale: float) -> None:
    """Scale of the router losses' gradient for the coming forward passes (loss_scale / micro-batches)."""
    for layer in moe_layer_modules(model_chunks):
        layer.aux_loss_scale = float(scale)


def _layer_figures(row: list[float], num_experts: int) -> dict[str, float]:
    """One layer's figures from its row of the step's table (host values: no device read here)."""
    counts = row[:num_experts]
    s = dict(zip(SCALARS, row[num_experts:]))
    mean = sum(counts) / num_experts
    std = math.sqrt(sum((c - mean) ** 2 for c in counts) / num_experts)
    return {
        "tokens_min": min(counts),
        "tokens_max": max(counts),
        "tokens_cv": std / mean if mean > 0 else 0.0,
        "dropped_fraction": s["dropped"] / max(s["pairs"], 1.0),
        "dead_experts": float(sum(c == 0 for c in counts)),
        "router_entropy": s["entropy_sum"] / max(s["tokens"], 1.0),
        "aux_loss": s["load_balancing_sum"] / s["calls"],
        "z_loss": s["z_loss_sum"] / s["calls"],
    }


def collect_moe_metrics(
    model_chunks,
    *,
    num_layers: int,
    num_experts: int,
    group=None,
    max_keys: int = 64,
    device=None,
    reset: bool = True,
    expert_counts: dict | None = None,
) -> dict[str, float]:
    """Step figures of every MoE layer of the model; call on EVERY rank, once per step.

    One all-reduce of a fixed [num_layers, num_experts + 7] table over `group`
    (default: the world), so ranks whose pipeline stage has no MoE layer join
    with zeros and nothing can hang; then ONE device->host copy of the table
    (`table_to_host`), from which every figure is computed on the host. Every rank of a stage routes different
    tokens (DP, EP, and TP under sequence parallelism), so summing gives the
    counts of the whole step. Losses are unweighted means over ranks and
    micro-batches. Returns aggregates (`moe aux loss`, `moe z loss`,
    `moe dropped fraction`, `moe tokens cv`, `moe tokens cv max`,
    `moe dead experts`, `moe router entropy`) and `moe/layer_NNN/<figure>`
    for as many layers as fit in `max_keys` (evenly spaced, the same layers
    every step). `expert_counts`, a dict, gets every MoE layer's tokens per
    expert over the step: {layer number: [count per expert]}.
    """
    width = num_experts + len(SCALARS)
    device = current_platform().device if device is None else device  # where the backend reduces
    table = torch.zeros(num_layers, width, dtype=torch.float64, device=device)
    for layer in moe_layer_modules(model_chunks):
        if layer.stats.sums is not None and layer.layer_number is not None:
            sums = layer.stats.sums
            sums = sums if sums.device == table.device else sums.to(table.device)
            e = layer.stats.num_experts
            table[layer.layer_number - 1, :e] += sums[:e]
            table[layer.layer_number - 1, num_experts:] += sums[e:]
        if reset:
            layer.stats.reset()
    comm.reduce_moe_metrics(table, group)
    with comm.host_read("moe metrics"):
        rows = table_to_host(table)  # the step's one device read for its MoE figures, whatever the number of layers
    present = [i for i in range(num_layers) if rows[i][-1] > 0]  # calls
    if not present:
        return {}
    per_layer = {i + 1: _layer_figures(rows[i], num_experts) for i in present}
    if expert_counts is not None:
        expert_counts.update({i + 1: rows[i][:num_experts] for i in present})
    dropped, pairs = (sum(rows[i][num_experts + k] for i in present) for k in (0, 1))
    figures = {
        "moe aux loss": sum(f["aux_loss"] for f in per_layer.values()) / len(per_layer),
        "moe z loss": sum(f["z_loss"] for f in per_layer.values()) / len(per_layer),
        "moe dropped fraction": dropped / max(pairs, 1.0),
        "moe tokens cv": sum(f["tokens_cv"] for f in per_layer.values()) / len(per_layer),
        "moe tokens cv max": max(f["tokens_cv"] for f in per_layer.values()),
        "moe dead experts": sum(f["dead_experts"] for f in per_layer.values()),
        "moe router entropy": sum(f["router_entropy"] for f in per_layer.values()) / len(per_layer),
    }
    room = max(0, (max_keys - len(figures)) // len(PER_LAYER))
    shown = list(per_layer)
    if room < len(shown):
        shown = [shown[round(j * (len(shown) - 1) / max(room - 1, 1))] for j in range(room)] if room else []
    for number in dict.fromkeys(shown):
        for name, value in per_layer[number].items():
            figures[f"moe/layer_{number:03d}/{name}"] = value
    return figures
