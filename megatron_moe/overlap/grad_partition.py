"""FSMoE's adaptive gradient partition (section 5), as pure code: how many gradient bytes each MoE layer's
backward all-reduces, so that the data-parallel reduction runs inside the MoE layers instead of after backward.

Inputs: the fits (the "ar" line: t_ar(n) = alpha_ar + n beta_ar), the `GeneralizedLayer`s in backward order
(MoE layer i and what follows it up to the next: the gradient bytes complete before its backward) and the
`tail_bytes` after the first MoE layer's backward. Output: a `GradPartition` (bytes assigned per MoE layer, the
tail, the predicted times). Method: step 1 (eqs. 3-4) fills each layer's overlappable time; step 2 (eq. 5)
spreads the rest by differential evolution. Invariant: a layer is assigned only gradients that exist before its
backward. Derivation and deviations: docs/internals/overlap.md ("The adaptive gradient partition: the plan").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from megatron_moe.config.fields import require
from megatron_moe.overlap.cost_model import (
    ClusterFits,
    LayerSizes,
    brute_force,
    chunk_times,
    predict,
    required_gain,
    solve_degrees,
)

SEED = 16
"""The differential evolution's seed: every rank computes the same plan from the same (agreed) fits."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GeneralizedLayer:
    """One MoE layer of the plan, in backward order."""

    layer: int
    """The MoE layer's number (1-based, megatron-core's), where its share is launched."""
    sizes: LayerSizes
    grad_bytes: float
    """Gradient bytes made since the previous MoE layer's backward began (docs/internals/overlap.md)."""
    t_olp_dense_ms: float = 0.0
    """Dense backward after this MoE layer's, down to the next one, that also hides the reduction (0: none)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradPartition:
    """Bytes each MoE layer all-reduces in its backward, and the model's times."""

    first: dict[int, float]
    """Step 1: layer -> bytes that fit in its overlappable time."""
    assigned: dict[int, float]
    """Steps 1 + 2: layer -> bytes it all-reduces."""
    tail_bytes: float
    """Bytes reduced after backward: the step-2 rest plus the gradients below the first MoE layer."""
    olp_ms: dict[int, float]
    """Layer -> its overlappable time t_olp at t_gar = 0."""
    predicted_ms: dict
    """"layers": layer -> its backward time with its all-reduce; "tail": the exposed all-reduce after backward;
    "total"; "megatron": the same layers with nothing in them and every byte reduced after backward; "floor": the
    all-reduce of the gradients made after the first MoE layer's backward began (the lowest layer's, the
    embedding's): only their own backward is left to hide it, so about this much stays exposed whatever the
    launch order or the buckets (ours, megatron-core's small ones)."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def pays(self, min_gain: float) -> bool:
        """Whether the plan's backward is predicted at least `min_gain` faster than megatron-core's reduction after
        it (what --moe-overlap-choice auto keeps the partition for)."""
        return self.predicted_ms["total"] <= self.predicted_ms["megatron"] * (1.0 - min_gain)


def t_ar_ms(fits: ClusterFits, n: float) -> float:
    """The all-reduce of n bytes; 0 for none."""
    fit = fits["ar"]
    return 0.0 if n <= 0 else max(fit.alpha, 0.0) + n * max(fit.beta, 0.0)


def g_inv_bytes(fits: ClusterFits, t_ms: float) -> float:
    """The bytes an all-reduce moves in t_ms (0 when t_ms is below its start-up; unbounded with beta = 0)."""
    fit = fits["ar"]
    if t_ms <= max(fit.alpha, 0.0):
        return 0.0
    return float("inf") if fit.beta <= 0 else (t_ms - max(fit.alpha, 0.0)) / fit.beta


def overlappable_ms(fits: ClusterFits, sizes: LayerSizes, *, dw_in_backward: bool, max_degree: int) -> float:
    """t_olp,moe of one layer's backward at its t_gar = 0 degrees (docs/internals/overlap.md)."""
    schedule = solve_degrees(fits, sizes, t_gar_ms=0.0, max_degree=max_degree, dw_in_backward=dw_in_backward)
    r, case = schedule.backward, schedule.case["backward"]
    t = chunk_times(fits, sizes, r, "backward")
    olp = {
        1: 0.0,
        2: r * t.exp + t.ag + t.rs - 2 * (r - 1) * t.a2a,
        3: t.ag + t.rs,
        4: r * t.ag + r * t.rs - 2 * (r - 1) * t.a2a,
    }[case]
    return max(olp, 0.0)


def f_moe_ms(fits: ClusterFits, sizes: LayerSizes, t_gar_ms: float, *, dw_in_backward: bool, max_degree: int):
    """Algorithm 1's backward time of one layer with `t_gar_ms` of all-reduce in it. Evaluated as the best integer
    degree by the model (with `required_gain`'s rule), which is what Algorithm 1 returns
    (tests/unit/test_cost_model.py) at a fraction of SLSQP's cost: the differential evolution calls it thousands
    of times."""
    kw = {"t_gar_ms": t_gar_ms, "dw_in_backward": dw_in_backward}
    best = brute_force(fits, sizes, range(1, max_degree + 1), **kw).predicted_ms["backward"]
    unpipelined = predict(fits, sizes, 1, 1, **kw).predicted_ms["backward"]
    return best if best <= (1.0 - required_gain(fits, "backward")) * unpipelined else unpipelined


def partition(
    fits: ClusterFits,
    layers: Sequence[GeneralizedLayer],
    tail_bytes: float,
    *,
    dw_in_backward: bool = True,
    max_degree: int = 8,
    maxiter: int = 40,
) -> GradPartition:
    """Steps 1 and 2 (docs/internals/overlap.md) for `layers` in backward order."""
    require(all(g.grad_bytes >= 0 for g in layers), "grad_bytes", [g.grad_bytes for g in layers], ">= 0")
    require(tail_bytes >= 0, "tail_bytes", tail_bytes, ">= 0")
    kw = {"dw_in_backward": dw_in_backward, "max_degree": max_degree}
    olp = {g.layer: overlappable_ms(fits, g.sizes, **kw) + g.t_olp_dense_ms for g in layers}

    # Step 1: fill each layer's overlappable time with the oldest unassigned bytes.
    first, remaining, pool = {}, [], []  # pool: [bytes, made at index] oldest first
    for i, g in enumerate(layers):
        pool.append([g.grad_bytes, i])
        room = g_inv_bytes(fits, olp[g.layer])
        take = 0.0
        while pool and room > take:
            piece = min(pool[0][0], room - take)
            take += piece
            pool[0][0] -= piece
            if pool[0][0] <= 0:
                pool.pop(0)
        first[g.layer] = take
    remaining = [0.0] * len(layers)
    for n, i in pool:
        remaining[i] += n

    def spread(fractions: np.ndarray) -> tuple[list[float], float]:
        """x_g^i as the fraction of what is available at layer i; what is left after the last layer."""
        available, x = 0.0, []
        for i, fraction in enumerate(fractions):
            available += remaining[i]
            x.append(float(fraction) * available)
            available -= x[-1]
        return x, available

    def total(x: Sequence[float], rest: float) -> float:
        layer_ms = sum(f_moe_ms(fits, g.sizes, t_ar_ms(fits, first[g.layer] + xi), **kw) for g, xi in zip(layers, x))
        return layer_ms + t_ar_ms(fits, rest + tail_bytes)

    # Step 2: differential evolution over the fractions (only when step 1 left something to place).
    if sum(remaining) > 0 and layers:
        from scipy.optimize import differential_evolution  # 0.65 s to import: only where a partition is searched

        result = differential_evolution(
            lambda f: total(*spread(f)), bounds=[(0.0, 1.0)] * len(layers), seed=SEED, maxiter=maxiter, tol=1e-6,
            polish=False, init="sobol", popsize=10,
        )  # fmt: skip
        candidates = [result.x, np.zeros(len(layers)), np.ones(len(layers))]  # never worse than either extreme
        best = min(candidates, key=lambda f: total(*spread(f)))
        x, rest = spread(best)
    else:
        x, rest = [0.0] * len(layers), sum(remaining)

    assigned = {g.layer: first[g.layer] + xi for g, xi in zip(layers, x)}
    layer_ms = {g.layer: f_moe_ms(fits, g.sizes, t_ar_ms(fits, assigned[g.layer]), **kw) for g in layers}
    all_bytes = sum(g.grad_bytes for g in layers) + tail_bytes
    megatron = sum(f_moe_ms(fits, g.sizes, 0.0, **kw) for g in layers) + t_ar_ms(fits, all_bytes)
    tail_ms = t_ar_ms(fits, rest + tail_bytes)
    return GradPartition(
        first=first,
        assigned=assigned,
        tail_bytes=rest + tail_bytes,
        olp_ms=olp,
        predicted_ms={
            "layers": layer_ms,
            "tail": tail_ms,
            "total": sum(layer_ms.values()) + tail_ms,
            "megatron": megatron,
            "floor": t_ar_ms(fits, tail_bytes),
        },
    )
