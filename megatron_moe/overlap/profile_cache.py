"""The cost-model profile a run can trust: its fingerprint, one cached profile per fingerprint, and the check of
its fits. Pure code (no process group): `megatron_moe.overlap.profiler` gathers the facts and decides.

Inputs: a cluster description (`profiler.describe_cluster`: groups, hosts, devices, link, dtype, settings and
`code_version()` of `CODE_MODULES`) and fitted lines. Outputs: `cache_path` (one file per fingerprint),
`fit_problems` (the lines not to be trusted, by `FitCheck`), `differences` / `newest_differs` (why a saved one
does not match), `fits_table` (the start-up table). Invariant: a profile is reused only by a run whose description
is equal; a changed measuring or fitting module changes the fingerprint. Why a cache, and why R^2 alone is no
test of a line (with the measured figures): docs/internals/overlap.md ("The profile cache").
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib
import importlib.metadata
import json
import math
import os

from megatron_moe.overlap.cost_model import OVERHEAD_KINDS, ClusterFits, LinearFit

CODE_MODULES = (
    "megatron_moe.overlap.profiler",
    "megatron_moe.overlap.measure",
    "megatron_moe.overlap.profile_settings",
    "megatron_moe.overlap.cost_model",
    "megatron_moe.overlap.fits",
    "megatron_moe.comm.profiling",
    "megatron_moe.moe.pipeline",
)
"""The code whose edits make a saved profile stale: what is measured and how it is timed (the profiler, its
collectives, the pipeline it runs) and how it is fitted (the cost model)."""
CACHE_ENV = "MEGATRON_MOE_CACHE_DIR"
"""Overrides ~/.cache/megatron_moe (tests point it at a temporary directory)."""


def code_version() -> dict:
    """{"megatron_moe": the installed version, "source": sha256 (16 hex) of `CODE_MODULES`' files}."""
    digest = hashlib.sha256()
    for name in CODE_MODULES:
        with open(importlib.import_module(name).__file__, "rb") as stream:
            digest.update(stream.read())
    try:
        version = importlib.metadata.version("megatron_moe")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"megatron_moe": version, "source": digest.hexdigest()[:16]}


def default_cache_dir() -> str:
    """$MEGATRON_MOE_CACHE_DIR, else $XDG_CACHE_HOME/megatron_moe, else ~/.cache/megatron_moe; /cost_profiles."""
    base = os.environ.get(CACHE_ENV)
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megatron_moe")
    return os.path.join(base, "cost_profiles")


def fingerprint_key(description: dict) -> str:
    """16 hex digits of the description's sha256 (canonical JSON): the cache file's name."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_path(cache_dir: str, description: dict) -> str:
    return os.path.join(cache_dir, f"cost_profile_{fingerprint_key(description)}.json")


def table_path(path: str) -> str:
    """The human-readable table beside a profile: fits.json -> fits.table.txt."""
    return (path[: -len(".json")] if path.endswith(".json") else path) + ".table.txt"


def differences(saved: dict, wanted: dict) -> list[str]:
    """The description's keys whose values differ (sorted): why a saved profile is not this run's."""
    return sorted(key for key in saved.keys() | wanted.keys() if saved.get(key) != wanted.get(key))


def newest_differs(directory: str, description: dict) -> str:
    """'; the newest profile there differs in code, hosts' (the fields), or '' where `directory` holds no other
    profile: why a cache had none for this fingerprint (an upgrade, another placement)."""
    saved = glob.glob(os.path.join(directory, "cost_profile_*.json"))
    if not saved:
        return ""
    try:
        cluster = ClusterFits.load(max(saved, key=os.path.getmtime)).cluster
    except (OSError, ValueError, KeyError):
        return ""
    return f"; the newest profile there differs in {', '.join(differences(cluster, description))}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitCheck:
    """When a fitted line is not to be trusted (docs/internals/overlap.md)."""

    min_r2: float = 0.9
    """R^2 below which a line is suspect; 0 or less: no check, every line is trusted."""
    max_scatter: float = 0.25
    """A suspect line is unreliable when the RMS of its points' distance to it exceeds this share of their mean:
    beyond the model's own error on the pipeline (median 1-23%, docs/overlap.md)."""

    @property
    def off(self) -> bool:
        return self.min_r2 <= 0


def scatter(fit: LinearFit) -> float:
    """RMS of the points' distance to the line / the mean of their times (inf when that mean is not positive)."""
    times = [ms for _, ms in fit.points]
    mean = sum(times) / len(times)
    rms = math.sqrt(sum((fit.time_ms(n) - ms) ** 2 for n, ms in fit.points) / len(times))
    return rms / mean if mean > 0 else math.inf


def fit_problems(fits: ClusterFits, check: FitCheck = FitCheck()) -> dict[str, str]:
    """Kind -> why its line is not to be trusted (empty: every measured line is). Lines without points (given by
    hand) are not judged."""
    if check.off:
        return {}
    problems = {}
    for kind, fit in judged_lines(fits).items():
        ends = (min(n for n, _ in fit.points), max(n for n, _ in fit.points))
        lowest = min(fit.time_ms(n) for n in ends)
        if lowest < 0:
            problems[kind] = f"negative time {lowest:.3g} ms in its measured range"
        elif fit.r2 < check.min_r2 and scatter(fit) > check.max_scatter:
            problems[kind] = f"R^2 {fit.r2:.2f}, points {scatter(fit):.0%} off the line"
    return problems


def usable_fits(fits: ClusterFits, problems: dict[str, str]) -> ClusterFits | None:
    """The fits the run may plan with: all of them without problems; without the dense lines where only those are
    unreliable (the operator partition then declines, as for a profile without them); None where a line the
    pipeline degrees, the gradient partition or the shadow experts price with is unreliable (their no-profile
    defaults: degree 1, megatron-core's buckets, no shadows)."""
    if not problems:
        return fits
    dense = {kind for kind in fits.fits if kind.removesuffix("_bwd") in ("attn", "mlp", "route", "unroute")}
    if not set(problems) <= dense:
        return None
    return dataclasses.replace(fits, fits={k: v for k, v in fits.fits.items() if k not in dense})


def judged_lines(fits: ClusterFits) -> dict[str, LinearFit]:
    """The time lines a check judges: measured (2 or more points), not a correction."""
    return {kind: fit for kind, fit in fits.fits.items() if kind not in OVERHEAD_KINDS and len(fit.points) > 1}


def quality(fits: ClusterFits) -> str:
    """The fits' quality in a few words: the lowest R^2 and its kind, the largest scatter, the model's error."""
    parts = []
    if judged := judged_lines(fits):
        r2, kind = min((fit.r2, kind) for kind, fit in judged.items())
        worst = max(scatter(fit) for fit in judged.values())
        parts.append(f"lowest R^2 {r2:.2f} ({kind}), points within {worst:.0%} of their lines")
    if fits.model_error:
        parts.append(f"model error {max(fits.model_error.values()):.0%} (a degree > 1 must gain more)")
    return ", ".join(parts) or "given by hand"


def fits_table(fits: ClusterFits, source: str) -> str:
    """The whole profile as text: one line per kind (alpha, beta, R^2, points), the model's error, where it came
    from. What --verbose prints and the file beside the profile holds."""
    lines = [f"cost-model profile ({source}), t = alpha + n * beta in ms:"]
    for kind, fit in sorted(fits.fits.items(), key=lambda item: (item[0] in OVERHEAD_KINDS, item[0])):
        points = ", ".join(f"({n:.0f}, {ms:.4g})" for n, ms in fit.points) or "none (not measured here)"
        r2 = round(fit.r2, 4) + 0.0  # no "-0.0000"
        what = "correction (signed residual of the model)" if kind in OVERHEAD_KINDS else f"R^2 {r2:.4f}"
        lines.append(f"  {kind:<13} alpha {fit.alpha:.4g} beta {fit.beta:.4g} {what} points {points}")
    if fits.model_error:
        errors = ", ".join(f"{direction} {error:.1%}" for direction, error in fits.model_error.items())
        lines.append(f"  the model's largest error on the profiled pipeline: {errors} (a degree > 1 must gain more)")
    return "\n".join(lines) + "\n"
