"""FSMoE's cost model and pipeline-degree solver (Algorithm 1), as pure code: no process group, no tensors.

Legend: G = EP group size, P = ESP group size (expert-tensor-parallel), L = local experts (E / G), r = pipeline
degree (chunks), T = tokens this rank routes, k = top-k, H = hidden, F = one expert's FFN width.
Inputs: `ClusterFits` (fits.py; re-exported here) and one MoE layer's `LayerSizes` on this rank. Outputs:
`chunk_times` (t_x,r = alpha_x + n_x / r * beta_x, FSMoE eq. 1), `layer_time_ms` (the four cases of section 4.2),
`solve_degrees` -> `Schedule` (Algorithm 1: SLSQP per case, integers around each optimum evaluated, best wins),
`predict`, `brute_force`. Times are ms; forward runs with t_gar = 0, backward with the given t_gar.
Invariant: a degree > 1 is chosen only where predicted to save `required_gain` of r = 1's time.
Deviations from the paper: docs/cost-model.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from megatron_moe.config.fields import require
from megatron_moe.overlap.fits import (
    BACKWARD_KINDS,
    DENSE_BACKWARD_FACTOR,
    DENSE_KINDS,
    FIT_KINDS,
    FORMAT,
    OVERHEAD_KINDS,
    ClusterFits,
    LinearFit,
    fit_linear,
)

__all__ = [  # the model, and the lines it runs on (fits.py)
    "BACKWARD_KINDS",
    "CASES",
    "DENSE_BACKWARD_FACTOR",
    "DENSE_KINDS",
    "DIRECTIONS",
    "FIT_KINDS",
    "FORMAT",
    "MIN_GAIN",
    "OVERHEAD_KINDS",
    "ChunkTimes",
    "ClusterFits",
    "LayerSizes",
    "LinearFit",
    "Schedule",
    "brute_force",
    "capacity_rows",
    "case_at",
    "case_time_ms",
    "chunk_times",
    "condition_margins",
    "fit_linear",
    "layer_time_ms",
    "overhead_ms",
    "predict",
    "required_gain",
    "solve_degrees",
    "weight_grad_ms",
]

MIN_GAIN = 0.05
"""A degree > 1 must be predicted to save this share of r = 1's time, else r = 1 runs: below it the gain is inside
the model's error (median 1-23% of the measured layer in tools/bench_pipeline.py), and r = 1 is the safe side."""
CASES = (1, 2, 3, 4)
DIRECTIONS = ("forward", "backward")


def required_gain(fits: ClusterFits, direction: str, min_gain: float = MIN_GAIN) -> float:
    """The share of r = 1's time a degree > 1 must be predicted to save in `direction`: `min_gain`, or the model's
    own error on the profiled pipeline where that is larger (docs/internals/overlap.md)."""
    return max(min_gain, fits.model_error.get(direction, 0.0))


def capacity_rows(capacity_factor: float, tokens: int, topk: int, num_experts: int) -> int:
    """ceil(|f| * k * T / E), at least 1: `megatron_moe.moe.capacity.capacity_limit` (restated here so the model
    imports no torch; tests/unit/test_cost_model.py checks they agree)."""
    return max(1, math.ceil(abs(capacity_factor) * topk * tokens / num_experts))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSizes:
    """One MoE layer's work on one rank, whole (r = 1): the n_x of the cost model."""

    n_a2a: float
    """Bytes this rank sends in the dispatch all-to-all (the combine sends the same back)."""
    n_ag: float
    """Bytes of the ESP all-gather's output on this rank (0 without ESP)."""
    n_rs: float
    """Bytes of the ESP reduce-scatter's input on this rank (0 without ESP)."""
    n_exp: float
    """Multiply-adds of this rank's expert GEMMs in forward (all chunks together)."""
    ep: int = 1
    """G, the EP group size (1: no all-to-all, nothing to pipeline)."""
    esp: int = 1
    """P, the ESP group size."""

    @classmethod
    def from_layer(
        cls,
        *,
        tokens: int,
        topk: int,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        ep: int = 1,
        esp: int = 1,
        capacity_factor: float | None = None,
        padded: bool = False,
        dtype_bytes: int = 4,
        gated: bool = False,
    ) -> LayerSizes:
        """The sizes of one layer under balanced routing (every expert gets k * T / E of a rank's tokens).

        Rows a rank sends: dropless (f None or 0) T * k, padded E * ceil(k * T / E); f > 0 the kept rows
        min(T * k, E * C) with C = ceil(f * k * T / E), padded E * C; f < 0 (adaptive) as dropless, capped at C.
        A rank receives as many rows as it sends; with ESP it gathers its P peers' (P x as many) and computes
        their F / P slice: multiply-adds P * rows * H * F / P * (2, or 3 gated).
        """
        for flag, value in (
            ("--micro-batch-size x --seq-length", tokens),
            ("--moe-router-topk", topk),
            ("--hidden-size", hidden_size),
            ("--moe-ffn-hidden-size", ffn_hidden_size),
            ("--num-experts", num_experts),
            ("--expert-model-parallel-size", ep),
            ("--expert-tensor-parallel-size", esp),
            ("dtype bytes", dtype_bytes),
        ):
            require(isinstance(value, int) and value >= 1, flag, value, "must be an integer >= 1")
        require(num_experts % ep == 0, "--num-experts", num_experts, f"must be a multiple of EP={ep}")
        require(ffn_hidden_size % esp == 0, "--moe-ffn-hidden-size", ffn_hidden_size, f"must split over ESP={esp}")
        pairs = tokens * topk
        balanced = math.ceil(pairs / num_experts)
        if capacity_factor is None or capacity_factor == 0:
            per_expert = balanced
        else:
            limit = capacity_rows(capacity_factor, tokens, topk, num_experts)
            per_expert = limit if capacity_factor > 0 and padded else min(balanced, limit)
        rows = num_experts * per_expert if padded else min(pairs, num_experts * per_expert)
        row_bytes = hidden_size * dtype_bytes
        gathered = esp * rows * row_bytes if esp > 1 else 0
        return cls(
            n_a2a=float(rows * row_bytes) if ep > 1 else 0.0,
            n_ag=float(gathered),
            n_rs=float(gathered),
            n_exp=float(rows * hidden_size * ffn_hidden_size * (3 if gated else 2)),
            ep=ep,
            esp=esp,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkTimes:
    """Per-chunk times at degree r (ms): t_a2a,r, t_ag,r, t_rs,r, t_exp,r."""

    a2a: float
    ag: float
    rs: float
    exp: float


def _per_chunk(fit: LinearFit, n: float, r: float) -> float:
    return 0.0 if n <= 0 else max(fit.alpha, 0.0) + n / r * max(fit.beta, 0.0)


def chunk_times(fits: ClusterFits, sizes: LayerSizes, r: float, direction: str = "forward") -> ChunkTimes:
    """FSMoE eq. 1 at degree r; the expert time on the direction's line (docs/internals/overlap.md)."""
    require(direction in DIRECTIONS, "direction", direction, f"one of {DIRECTIONS}")
    return ChunkTimes(
        a2a=_per_chunk(fits["a2a"], sizes.n_a2a, r),
        ag=_per_chunk(fits["ag"], sizes.n_ag, r),
        rs=_per_chunk(fits["rs"], sizes.n_rs, r),
        exp=_per_chunk(fits["gemm" if direction == "forward" else "gemm_bwd"], sizes.n_exp, r),
    )


def case_time_ms(case: int, t: ChunkTimes, r: float, t_gar_ms: float) -> float:
    """f_case(r): FSMoE's layer time when case `case` holds (eqs. 2 and the three after it)."""
    if case == 1:  # inter-node communication (all-to-all and gradient all-reduce) dominates
        return 2 * r * t.a2a + t_gar_ms
    if case == 2:  # the experts dominate
        return 2 * t.a2a + t.ag + t.rs + r * t.exp
    if case == 3:  # the all-to-all dominates, slower than the intra-node steps
        return 2 * r * t.a2a + t.ag + t.rs
    if case == 4:  # intra-node all-gather / reduce-scatter dominates
        return 2 * t.a2a + r * t.ag + r * t.rs
    raise ValueError(f"case {case}: one of {CASES}")


def condition_margins(t: ChunkTimes, r: float, t_gar_ms: float) -> tuple[float, ...]:
    """Q1..Q7 of FSMoE section 4.2 as left side minus right side: Q_i holds when its margin is > 0."""
    return (
        t.a2a - t.ag,  # Q1: the all-to-all is slower than the all-gather (and, assumed alike, the reduce-scatter)
        r * t.exp - 2 * (r - 1) * t.a2a,  # Q2: the experts outlast the all-to-alls but the first and the last
        r * t.exp - ((r - 1) * t.ag + t.rs),  # Q3
        t_gar_ms - (t.ag + t.rs),  # Q4
        t_gar_ms - (r * t.exp - 2 * (r - 1) * t.a2a + t.ag + t.rs),  # Q5
        t_gar_ms - (r * t.ag + r * t.rs - 2 * (r - 1) * t.a2a),  # Q6
        t_gar_ms - (t.ag + t.rs + r * t.exp - 2 * (r - 1) * t.a2a),  # Q7
    )


def case_at(t: ChunkTimes, r: float, t_gar_ms: float) -> int:
    """The case whose conditions hold at r, Q1..Q7 as written in the paper (the four cases partition).

    Where a case's conditions hold its time is the larger of the two cases they compare, but for Q3: the paper's
    right side is (r - 1) t_ag + t_rs where cases 2 and 4 differ by (r - 1) (t_ag + t_rs); kept as written."""
    q1, q2, q3, q4, q5, q6, q7 = (margin > 0 for margin in condition_margins(t, r, t_gar_ms))
    if (q1 and not q2 and q4) or (q1 and q2 and q5) or (not q1 and not q3 and q6) or (not q1 and q3 and q7):
        return 1
    if (q1 and q2) or (not q1 and q3):  # not Q5 / not Q7: case 1 was refused above
        return 2
    return 3 if q1 else 4  # Q1, not Q2, not Q4 / not Q1, not Q3, not Q6


def weight_grad_ms(fits: ClusterFits, sizes: LayerSizes) -> float:
    """The experts' weight gradients over all rows (one run, the r = 1 arithmetic)."""
    return _per_chunk(fits["gemm_dw"], sizes.n_exp, 1)


def overhead_ms(fits: ClusterFits, sizes: LayerSizes, r: float, direction: str) -> float:
    """The pipeline's time beyond the four-case model at degree r (docs/internals/overlap.md): the chunk line at r > 1,
    the unchunked alpha at r = 1; 0 with nothing to pipeline (G = 1)."""
    if sizes.ep == 1 or sizes.n_a2a <= 0:
        return 0.0
    suffix = "" if direction == "forward" else "_bwd"
    if r <= 1:
        return fits["unchunked" + suffix].alpha
    fit = fits["chunk" + suffix]
    return max(fit.alpha, 0.0) + (r - 1) * max(fit.beta, 0.0)


def layer_time_ms(
    fits: ClusterFits,
    sizes: LayerSizes,
    r: float,
    direction: str = "forward",
    *,
    t_gar_ms: float = 0.0,
    dw_in_backward: bool = True,
) -> tuple[float, int]:
    """The model's time of one direction of the layer at degree r, and the case that holds there: f_case(r) plus
    the pipeline's overhead, and backward with `dw_in_backward` the weight gradients' time beyond the last
    all-to-all they run under."""
    t = chunk_times(fits, sizes, r, direction)
    gar = t_gar_ms if direction == "backward" else 0.0
    case = case_at(t, r, gar)
    ms = case_time_ms(case, t, r, gar) + overhead_ms(fits, sizes, r, direction)
    if direction == "backward" and dw_in_backward:
        ms += max(0.0, weight_grad_ms(fits, sizes) - t.a2a)
    return ms, case


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """Pipeline degrees of one MoE layer and the model's times for them."""

    forward: int
    backward: int
    predicted_ms: dict[str, float]
    """"forward" / "backward": the model's time of that direction at its degree."""
    case: dict[str, int]
    """"forward" / "backward": the case (1-4) that holds at that degree."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Direction:
    """What one direction's time depends on besides r."""

    fits: ClusterFits
    sizes: LayerSizes
    direction: str
    t_gar_ms: float
    dw_in_backward: bool

    def time(self, r: float) -> tuple[float, int]:
        kw = {"t_gar_ms": self.t_gar_ms, "dw_in_backward": self.dw_in_backward}
        return layer_time_ms(self.fits, self.sizes, r, self.direction, **kw)

    def chunk(self, r: float) -> ChunkTimes:
        return chunk_times(self.fits, self.sizes, r, self.direction)

    @property
    def gar(self) -> float:
        return self.t_gar_ms if self.direction == "backward" else 0.0

    def best_integer(self, candidates: Iterable[int]) -> tuple[int, float, int]:
        scored = [(*self.time(r), r) for r in candidates]
        ms, case, r = min(scored, key=lambda s: (s[0], s[2]))
        return r, ms, case

    def solve_case(self, case: int, top: int, tail: bool) -> float:
        """argmin over [1, top] by SLSQP (continuous r) of f_case, plus with `tail` the weight gradients' time
        beyond the last all-to-all (t_dw - t_a2a,r: the backward's piece where they outlast it)."""
        t_dw = weight_grad_ms(self.fits, self.sizes) if tail else 0.0

        def f(r_1: np.ndarray) -> float:
            r = float(r_1[0])
            t = self.chunk(r)
            overhead = overhead_ms(self.fits, self.sizes, r, self.direction)
            return case_time_ms(case, t, r, self.gar) + overhead + (t_dw - t.a2a if tail else 0.0)

        x0 = np.array([math.sqrt(top)])  # a * r + b / r + c: convex when b >= 0, else its minimum is at a bound
        from scipy.optimize import minimize  # 0.65 s to import: only where a plan is solved, not in every process

        result = minimize(f, x0, method="SLSQP", bounds=[(1.0, float(top))])
        return min(max(float(result.x[0]), 1.0), float(top))

    def boundaries(self, top: int) -> list[float]:
        """Where a condition Q_i changes truth in [1, top] (every t_x,r is alpha + c / r, so r * margin_i(r) is a
        quadratic in r, read off from 3 points and solved), and where the weight gradients stop hiding under
        the last all-to-all (t_dw = t_a2a,r)."""
        r_3 = (1.0, 2.0, 3.0)
        margins = [condition_margins(self.chunk(r), r, self.gar) for r in r_3]
        roots = []
        for i in range(len(margins[0])):
            coefficients = np.polyfit(r_3, [r * m[i] for r, m in zip(r_3, margins)], 2)
            if np.any(coefficients):
                roots += [float(z.real) for z in np.roots(coefficients) if abs(z.imag) < 1e-12 and 1 <= z.real <= top]
        if self.direction == "backward" and self.dw_in_backward and self.sizes.n_a2a > 0:
            a2a, spare = self.fits["a2a"], weight_grad_ms(self.fits, self.sizes) - max(self.fits["a2a"].alpha, 0.0)
            if spare > 0 and a2a.beta > 0:
                roots.append(min(max(self.sizes.n_a2a * a2a.beta / spare, 1.0), float(top)))
        return roots

    def solve(self, max_degree: int, min_gain: float) -> tuple[int, float, int]:
        unpipelined = self.best_integer([1])
        min_gain = required_gain(self.fits, self.direction, min_gain)
        if self.sizes.ep == 1 or self.sizes.n_a2a <= 0:
            return unpipelined
        tails = (False, True) if self.direction == "backward" and self.dw_in_backward else (False,)
        optima = [self.solve_case(case, max_degree, tail) for case in CASES for tail in tails]
        candidates = {1, max_degree}
        for r in optima + self.boundaries(max_degree):
            candidates |= {max(1, math.floor(r)), min(max_degree, math.ceil(r))}
        best = self.best_integer(sorted(candidates))
        return best if best[1] <= (1.0 - min_gain) * unpipelined[1] else unpipelined


def _directions(fits, sizes, t_gar_ms: float, dw_in_backward: bool) -> tuple[_Direction, _Direction]:
    return tuple(_Direction(fits, sizes, d, t_gar_ms, dw_in_backward) for d in DIRECTIONS)


def _schedule(forward: tuple[int, float, int], backward: tuple[int, float, int]) -> Schedule:
    return Schedule(
        forward=forward[0],
        backward=backward[0],
        predicted_ms={"forward": forward[1], "backward": backward[1]},
        case={"forward": forward[2], "backward": backward[2]},
    )


def solve_degrees(
    fits: ClusterFits,
    sizes: LayerSizes,
    *,
    t_gar_ms: float = 0.0,
    max_degree: int = 8,
    dw_in_backward: bool = True,
    min_gain: float = MIN_GAIN,
) -> Schedule:
    """FSMoE Algorithm 1, per direction: SLSQP on f_1..f_4 over 1 <= r <= max_degree, the integers around each
    optimum (and the bounds 1, max_degree, and the boundaries between cases) evaluated with the model (the case
    that holds at each), the best kept, unless it saves less than `required_gain` of r = 1's time (`min_gain`, or
    the profile's `model_error` where larger; then r = 1).
    Forward: t_gar = 0; backward: `t_gar_ms` (the gradient all-reduce placed in this layer's backward), and the
    experts' weight gradients when they run in the layer's backward (`dw_in_backward`; False when Lancet defers
    them). G = 1: 1."""
    require(isinstance(max_degree, int) and max_degree >= 1, "max_degree", max_degree, "an integer >= 1, e.g. 8")
    require(t_gar_ms >= 0, "t_gar_ms", t_gar_ms, "must be >= 0 (0: no gradient all-reduce in the layer)")
    require(0 <= min_gain < 1, "min_gain", min_gain, "a fraction in [0, 1), e.g. 0.05")
    forward, backward = _directions(fits, sizes, t_gar_ms, dw_in_backward)
    return _schedule(forward.solve(max_degree, min_gain), backward.solve(max_degree, min_gain))


def predict(
    fits: ClusterFits,
    sizes: LayerSizes,
    forward: int,
    backward: int,
    *,
    t_gar_ms: float = 0.0,
    dw_in_backward: bool = True,
) -> Schedule:
    """The model's times for given degrees (r = 1, a fixed Tutel-style degree, a measured choice)."""
    fwd, bwd = _directions(fits, sizes, t_gar_ms, dw_in_backward)
    return _schedule((forward, *fwd.time(forward)), (backward, *bwd.time(backward)))


def brute_force(
    fits: ClusterFits,
    sizes: LayerSizes,
    degrees: Sequence[int] = (1, 2, 4, 8),
    *,
    t_gar_ms: float = 0.0,
    dw_in_backward: bool = True,
) -> Schedule:
    """The best of `degrees` per direction by the model (the directions are independent: degrees x degrees)."""
    fwd, bwd = _directions(fits, sizes, t_gar_ms, dw_in_backward)
    return _schedule(fwd.best_integer(degrees), bwd.best_integer(degrees))
