"""The cost model's measured lines: t_x(n) = alpha_x + n * beta_x per kind of operation, and their JSON.

Inputs: (n, ms) points (`fit_linear`, least squares with non-negative coefficients) or coefficients given by hand.
Output: `ClusterFits`, one `LinearFit` per `FIT_KINDS` (n in bytes for the collectives, multiply-adds for the
experts, tokens for `DENSE_KINDS`) plus the optional kinds, and the cluster it was measured on. Invariant: every
`FIT_KINDS` has a line; an optional line a profile lacks is derived (`ClusterFits.__getitem__`) or refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable

import numpy as np

from megatron_moe.files import write_json_atomic

FIT_KINDS = ("a2a", "ag", "rs", "ar", "gemm")
"""a2a: dispatch/combine all-to-all over the EP group (n: bytes this rank sends); ag: ESP all-gather (n: bytes of
its output on this rank); rs: ESP reduce-scatter (n: bytes of its input on this rank); ar: gradient all-reduce over
the data-parallel group (n: bytes reduced); gemm: one chunk of the experts' forward (n: its multiply-adds)."""
BACKWARD_KINDS = {"gemm_bwd": "gemm", "gemm_dw": "gemm"}
"""Lines a profile may add, and the line used where it has none: gemm_bwd, one chunk of the experts' input
gradients (n: the chunk's forward multiply-adds); gemm_dw, the experts' weight gradients over n multiply-adds."""
DENSE_KINDS = ("attn", "mlp", "route", "unroute")
"""Lines a profile may add, n = tokens this rank runs through the operator (a micro-batch, or a piece of one):
attn, the attention block (input norm, QKV, core attention, projection, residual add); mlp, a dense layer's MLP
block (pre-MLP norm, fc1, activation, fc2, residual add); route, a MoE layer's pre-MLP norm, router and order
(before the dispatch all-to-all; the count exchange is the "a2a" line's); unroute, the unorder and residual add
(after the combine). Each has a backward line `KIND_bwd` (input and weight gradients together). A profile saved
before these lines existed has none: `missing_dense` names them and the partition planner declines to plan."""
DENSE_BACKWARD_FACTOR = 2.0
"""A dense backward line a profile lacks is its forward line x this (input and weight gradients, each about the
forward's multiply-adds)."""
OVERHEAD_KINDS = ("chunk", "chunk_bwd", "unchunked", "unchunked_bwd")
"""Lines a profile may add: the pipelined layer's (r > 1) time beyond the model, forward and backward, t = alpha +
n * beta with n = chunks beyond the first (r - 1); and r = 1's (alpha alone); 0 where a profile has none."""
FORMAT = "megatron_moe.cluster_fits/1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearFit:
    """t = alpha + n * beta (ms), with the data it was fitted on."""

    alpha: float
    """Start-up time, ms."""
    beta: float
    """ms per unit of n (byte, or multiply-add for the GEMM)."""
    r2: float = 1.0
    """Coefficient of determination of the fit (1: the line passes through every point)."""
    points: tuple[tuple[float, float], ...] = ()
    """The measured (n, ms) pairs (empty for coefficients given by hand)."""

    def time_ms(self, n: float) -> float:
        return self.alpha + n * self.beta

    def to_json(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta, "r2": self.r2, "points": [list(p) for p in self.points]}

    @classmethod
    def from_json(cls, data: dict) -> LinearFit:
        points = tuple((float(n), float(ms)) for n, ms in data.get("points", ()))
        return cls(alpha=float(data["alpha"]), beta=float(data["beta"]), r2=float(data.get("r2", 1.0)), points=points)


def fit_linear(points: Iterable[tuple[float, float]]) -> LinearFit:
    """Least squares with an intercept over (n, ms) pairs; R^2 = 1 - SS_res / SS_tot (1 when every ms is equal
    and the line is exact). A start-up time or a per-unit time cannot be negative: when noise makes one come out
    below 0, the fit is the least-squares one with both >= 0 (scipy's nnls), i.e. that coefficient held at 0.
    ValueError for fewer than 2 distinct n."""
    pairs = tuple((float(n), float(ms)) for n, ms in points)
    if len({n for n, _ in pairs}) < 2:
        raise ValueError(f"fit_linear: needs points at 2 or more distinct sizes n, got {pairs}")
    n_N, ms_N = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    scale = float(np.max(np.abs(n_N)))  # n spans 1e5..1e8: a unit column keeps the solves well conditioned
    design_N2 = np.stack([np.ones_like(n_N), n_N / scale], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design_N2, ms_N, rcond=None)
    if alpha < 0 or beta < 0:
        from scipy.optimize import nnls  # scipy.optimize: 0.65 s of every process's import, here only when needed

        (alpha, beta), _ = nnls(design_N2, ms_N)
    beta /= scale
    residual = float(np.sum((ms_N - (alpha + beta * n_N)) ** 2))
    total = float(np.sum((ms_N - ms_N.mean()) ** 2))
    r2 = 1.0 - residual / total if total > 0 else (1.0 if residual == 0 else 0.0)
    return LinearFit(alpha=float(alpha), beta=float(beta), r2=r2, points=pairs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterFits:
    """One fit per `FIT_KINDS`, and the description of the cluster they were measured on."""

    fits: dict[str, LinearFit]
    cluster: dict = dataclasses.field(default_factory=dict)
    """What the profile is valid for (world size, group sizes, host names, link, dtype, ...): a saved profile is
    reused only by a run whose description is equal (`megatron_moe.overlap.profiler`)."""
    model_error: dict[str, float] = dataclasses.field(default_factory=dict)
    """"forward" / "backward": the model's largest relative error, |measured - model| / measured, on the pipeline
    the profile ran with the real links at each profiled degree; a degree > 1 must be predicted to save more than
    this (`required_gain`). Empty for coefficients given by hand."""

    def __post_init__(self):
        missing = [kind for kind in FIT_KINDS if kind not in self.fits]
        if missing:
            raise ValueError(f"cluster fits: no fit for {missing}; give one for each of {FIT_KINDS}")

    def __getitem__(self, kind: str) -> LinearFit:
        if kind in self.fits:
            return self.fits[kind]
        if kind in OVERHEAD_KINDS:
            return LinearFit(alpha=0.0, beta=0.0)
        forward = kind.removesuffix("_bwd")
        if forward in DENSE_KINDS and kind != forward and forward in self.fits:
            fit, factor = self.fits[forward], DENSE_BACKWARD_FACTOR
            return LinearFit(alpha=factor * fit.alpha, beta=factor * fit.beta)
        if forward in DENSE_KINDS:
            raise KeyError(f"cluster fits: no {kind!r} line (a profile saved before the dense lines; re-profile)")
        return self.fits[BACKWARD_KINDS[kind]]

    def missing_dense(self) -> list[str]:
        """The `DENSE_KINDS` this profile has no forward line for (all four for a profile saved before them)."""
        return [kind for kind in DENSE_KINDS if kind not in self.fits]

    @classmethod
    def from_coefficients(cls, alpha: dict[str, float], beta: dict[str, float], cluster: dict | None = None):
        """Fits given by hand: alpha[kind] ms, beta[kind] ms per unit (R^2 = 1, no points); every `FIT_KINDS`, and
        any optional kind (`BACKWARD_KINDS`, `OVERHEAD_KINDS`, `DENSE_KINDS` and their `_bwd`) given in both."""
        optional = [*BACKWARD_KINDS, *OVERHEAD_KINDS, *DENSE_KINDS, *(f"{k}_bwd" for k in DENSE_KINDS)]
        kinds = [*FIT_KINDS, *(k for k in optional if k in alpha and k in beta)]
        return cls(fits={k: LinearFit(alpha=alpha[k], beta=beta[k]) for k in kinds}, cluster=dict(cluster or {}))

    def to_json(self) -> dict:
        fits = {kind: fit.to_json() for kind, fit in self.fits.items()}
        return {"format": FORMAT, "cluster": self.cluster, "fits": fits, "model_error": self.model_error}

    @classmethod
    def from_json(cls, data: dict) -> ClusterFits:
        """ValueError for anything but a profile's JSON (`null`, a list, a field of the wrong type)."""
        if not isinstance(data, dict):
            raise ValueError(f"cluster fits: a JSON {type(data).__name__}, not a profile's object")
        if data.get("format") != FORMAT:
            raise ValueError(f"cluster fits: format {data.get('format')!r}; expected {FORMAT!r}")
        try:
            fits = cls(
                fits={k: LinearFit.from_json(v) for k, v in data["fits"].items()},
                cluster=data.get("cluster", {}),
                model_error={d: float(e) for d, e in data.get("model_error", {}).items()},
            )
        except (AttributeError, KeyError, TypeError) as error:
            raise ValueError(f"cluster fits: not a profile's fields ({type(error).__name__}: {error})") from None
        if not isinstance(fits.cluster, dict):
            raise ValueError(f"cluster fits: its cluster is a JSON {type(fits.cluster).__name__}, not an object")
        return fits

    def save(self, path: str) -> None:
        """Write the JSON atomically (a reader never sees half a file)."""
        write_json_atomic(path, self.to_json(), indent=1, sort_keys=True)

    @classmethod
    def load(cls, path: str) -> ClusterFits:
        with open(path) as f:
            return cls.from_json(json.load(f))
