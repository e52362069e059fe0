"""--moe-overlap-choice auto: which overlap features run, chosen on the fitted profile by the whole step's time.

Legend: M = micro-batches a step on this rank, PP = pipeline stages, f / b = one micro-batch's forward / backward
on this rank's stage, pair = one micro-batch's forward beside another's backward (`piece_schedule.paired_times`).
Inputs: the fits and this rank's `StageModel`s per candidate (training/overlap_choice.py builds them from the flags).
Outputs: `candidates`, `stage_times` -> `MicroBatchTimes`, `step_ms`, `decide` -> the features on, `OverlapChoice`.
Features (each decided only where its flag is at its default): batch-level overlap (default off: on where it
wins), Lancet's queue (default greedy) and the solved pipeline degrees (default auto: else 1 / 1), each off where
it hides too little, the operator partition under auto (exclusive with batch-level overlap here).
Step (stage 0, the one with the fewest pairs): (PP - 1)(f + b) of bubble, then M micro-batches, of which
max(0, M - PP) run as pairs under batch-level overlap (megatron-core's combined 1F1B).
Invariant: a feature goes on only where it is predicted to save `MIN_GAIN` of the step without it (`decide`), so
the choice is never predicted slower than leaving it off; every rank chooses alike (the agreed profile, and the
stages' predictions maxed over the world by the caller). Measured against the step: docs/overlap.md.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

from megatron_moe.overlap.cost_model import MIN_GAIN, ClusterFits
from megatron_moe.overlap.piece_schedule import StageModel, paired_times

FEATURES = ("batch", "wgrad", "pipeline", "partition")
NAMES = {
    "batch": "batch-level overlap (--overlap-moe-expert-parallel-comm)",
    "wgrad": "Lancet's weight-gradient queue (--overlap-wgrad greedy)",
    "pipeline": "FSMoE's pipeline degrees as solved (--moe-pipeline-degree auto)",
    "partition": "the operator partition (--moe-partition-pieces auto)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One setting of the features: which are on."""

    on: frozenset[str]

    def label(self) -> str:
        return "+".join(f for f in FEATURES if f in self.on) or "none"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroBatchTimes:
    """One micro-batch on this rank's stage (summed over its model chunks), ms."""

    forward: float
    backward: float
    pair: float | None
    """Forward beside another's backward (None: batch-level overlap not in this candidate)."""


def step_ms(times: MicroBatchTimes, micro_batches: int, pp: int) -> float:
    """The step on stage 0 (module docstring's formula)."""
    whole = times.forward + times.backward
    if times.pair is None:
        return (pp - 1 + micro_batches) * whole
    pairs = max(0, micro_batches - pp)
    return (pp - 1) * whole + (micro_batches - pairs) * whole + pairs * times.pair


def candidates(open_features: Sequence[str]) -> list[Candidate]:
    """Every subset of the features the choice decides, but batch-level overlap and the partition together."""
    out = []
    for n in range(len(open_features) + 1):
        for on in itertools.combinations(open_features, n):
            if not {"batch", "partition"} <= set(on):
                out.append(Candidate(on=frozenset(on)))
    return out


def stage_times(
    fits: ClusterFits,
    stages: Sequence[StageModel],
    candidate: Candidate,
    partitioned: Callable | None = None,
    paired: Sequence[StageModel] | None = None,
) -> MicroBatchTimes:
    """`candidate`'s micro-batch times over this rank's chunks (`stages`, one per model chunk, each already with
    or without Lancet's deferral as the candidate says). `partitioned(stage) -> (forward, backward)`: the
    operator partition's planned times where the candidate runs it. `paired`: the same chunks at the degrees a
    paired pass runs (`moe.handover.chunked`: the lone passes keep the pipeline's chunks, the paired run whole),
    else `stages`."""
    forward = backward = pair = 0.0
    for stage, pair_stage in zip(stages, paired or stages):
        f, b, p = paired_times(fits, stage)
        if pair_stage is not stage:
            p = paired_times(fits, pair_stage)[2]
        if "partition" in candidate.on and partitioned is not None:
            f, b = partitioned(stage)
        forward, backward, pair = forward + f, backward + b, pair + p
    return MicroBatchTimes(forward=forward, backward=backward, pair=pair if "batch" in candidate.on else None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlapChoice:
    """The verdict: the features on, each candidate's predicted step (ms, agreed over the ranks)."""

    open: tuple[str, ...]
    """The features the choice decided (at their defaults and possible in this run)."""
    on: frozenset[str]
    steps: dict[str, float]
    """Candidate label -> predicted step ms."""
    fixed: dict[str, str] = dataclasses.field(default_factory=dict)
    """Feature -> why the choice left it as given."""

    @property
    def predicted_ms(self) -> float:
        return self.steps[Candidate(on=self.on).label()]

    @property
    def none_ms(self) -> float:
        return self.steps["none"]

    def text(self) -> str:
        """The start-up line's body."""
        verdicts = [f"{NAMES[f]} {'on' if f in self.on else 'off'}" for f in self.open]
        verdicts += [f"{NAMES[f]} as given ({why})" for f, why in self.fixed.items()]
        table = ", ".join(f"{label} {ms:.1f}" for label, ms in self.steps.items())
        return f"{'; '.join(verdicts)}; predicted step {self.predicted_ms:.1f} ms (each setting's: {table})"


def decide(open_features: Sequence[str], steps: dict[str, float], min_gain: float = MIN_GAIN) -> frozenset[str]:
    """From none of the features, add the one whose candidate is fastest while it saves `min_gain` of the step
    without it (a gain inside the model's error is not taken), until none does."""
    on: frozenset[str] = frozenset()
    while True:
        here = steps[Candidate(on=on).label()]
        tried = [
            (steps[label], feature)
            for feature in open_features
            if feature not in on and (label := Candidate(on=on | {feature}).label()) in steps
        ]
        if not tried or min(tried)[0] > here * (1.0 - min_gain):
            return on
        on = on | {min(tried)[1]}
