"""`--overlap-report`: what the overlap planners chose and predicted at start-up, beside what the communication
timers measured once every plan is in force.

Inputs: the start-up `OverlapPlans` (FSMoE's degrees, Lancet's operator partition, FSMoE's gradient partition,
the overlap choice) and each step's `CommSummary` and time from the job's `FIRST_STEP`-th for `STEPS` steps.
Output: one report (`observe`, then `as_text`): per kind, per MoE layer, the partition, the gradient reduction
and the overlap choice's step, each prediction beside the measured figure of the same thing. Figures are the
logging rank's (the only one timed). What each figure compares: docs/internals/overlap.md ("The overlap report").
"""

from __future__ import annotations

import math
import statistics

from megatron_moe.comm.timers import SUMMARY_KINDS, CommSummary, hidden_share
from megatron_moe.overlap.runtime import OverlapPlans

FIRST_STEP = 3
"""The job's step from which Lancet's greedy plan runs (overlap/wgrad_queue.py `PROFILE_ITERATION` + 1)."""
STEPS = 10
A2A_KINDS = ("a2a_dispatch", "a2a_dispatch_bwd", "a2a_combine", "a2a_combine_bwd")
KIND_FIGURES = ("wire_ms", "exposed_ms", "skew_ms", "transfer_ms")
"""The per-kind figures the report sums (comm/timers.py `CommSummary`), in its table's column order."""


class OverlapReport:
    """Accumulates the timers' step summaries over the report's window; `observe` returns the report once."""

    def __init__(
        self, plans: OverlapPlans, *, job_steps: int, micro_batches: int, first: int = FIRST_STEP, steps: int = STEPS
    ):
        """`job_steps`: the steps this job will run (--train-iters less the iteration it resumed from);
        `micro_batches`: a step's on this rank (the partition's figures are per micro-batch)."""
        self.plans, self.micro_batches = plans, micro_batches
        self.first = min(first, job_steps)
        self.last = min(job_steps, self.first + steps - 1)
        self._job_step = 0
        self._kinds = {figure: dict.fromkeys(SUMMARY_KINDS, 0.0) for figure in KIND_FIGURES}
        self._layers: dict[int, dict[str, float]] = {}
        self._steps = 0
        self._step_ms: list[float] = []
        self.done = False

    def observe(self, iteration: int, summary: CommSummary, step_ms: float | None = None) -> dict | None:
        """Add the job's next step's summary and time (`iteration`: its global number, for the report); the report
        (`as_text` renders it) after the window's last step."""
        self._job_step += 1
        if self.done or self._job_step < self.first:
            return None
        self._steps += 1
        if step_ms is not None:
            self._step_ms.append(step_ms)
        for figure, sums in self._kinds.items():
            for kind in SUMMARY_KINDS:
                sums[kind] += getattr(summary, figure).get(kind, 0.0)
        for layer, figures in summary.per_layer.items():
            into = self._layers.setdefault(layer, {"wire_ms": 0.0, "exposed_ms": 0.0, "skew_ms": 0.0})
            for figure in into:
                into[figure] += sum(figures.get(figure, {}).get(kind, 0.0) for kind in A2A_KINDS)
        if self._job_step < self.last:
            return None
        self.done = True
        return self._report(iteration)

    def _report(self, iteration: int) -> dict:
        n, plans = self._steps, self.plans
        per_step = {figure: {k: v / n for k, v in values.items()} for figure, values in self._kinds.items()}
        kinds = {
            kind: {figure: per_step[figure][kind] for figure in KIND_FIGURES}
            | {"hidden": hidden_share(per_step["exposed_ms"][kind], per_step["wire_ms"][kind])}
            for kind in SUMMARY_KINDS
            if per_step["wire_ms"][kind] > 0 or per_step["exposed_ms"][kind] > 0
        }
        wire, exposed = math.fsum(per_step["wire_ms"].values()), math.fsum(per_step["exposed_ms"].values())
        layers = {}
        for layer, figures in sorted(self._layers.items()):
            entry = {f"a2a_{figure}": value / n for figure, value in figures.items()}
            entry["hidden"] = hidden_share(entry["a2a_exposed_ms"], entry["a2a_wire_ms"])
            if (schedule := plans.degrees.get(layer)) is not None:
                entry |= {"degrees": [schedule.forward, schedule.backward], "predicted_ms": schedule.predicted_ms}
            layers[layer] = entry
        report = {
            "iterations": [iteration - n + 1, iteration],
            "kinds": kinds,
            "wire_ms": wire,
            "exposed_ms": exposed,
            "skew_ms": math.fsum(per_step["skew_ms"].values()),
            "transfer_ms": math.fsum(per_step["transfer_ms"].values()),
            "hidden": hidden_share(exposed, wire),
            "layers": layers,
            "partition": [self._partition(chunk, layers) for chunk in plans.partition],
        }
        if (choice := plans.choice) is not None:
            report["choice"] = {
                "on": sorted(choice.on),
                "predicted_step_ms": choice.predicted_ms,
                "predicted_none_ms": choice.none_ms,
                "step_ms": statistics.median(self._step_ms) if self._step_ms else None,
            }
        if plans.grad_reduce is not None:
            report["grad_reduce"] = {
                "predicted_exposed_ms": plans.grad_reduce.predicted_ms["tail"],
                "exposed_ms": per_step["exposed_ms"]["dp_grad_reduce"],
                "wire_ms": per_step["wire_ms"]["dp_grad_reduce"],
            }
        return report

    def _partition(self, chunk: dict, layers: dict[int, dict]) -> dict:
        """A chunk's ranges and, where planned, its predicted hidden all-to-all time a micro-batch beside the
        measured one (wire - exposed of its layers' all-to-alls, per micro-batch)."""
        first, last = chunk["layers"]
        mine = [entry for layer, entry in layers.items() if first <= layer <= last]
        wire = math.fsum(e["a2a_wire_ms"] for e in mine) / self.micro_batches
        exposed = math.fsum(e["a2a_exposed_ms"] for e in mine) / self.micro_batches
        entry = {"layers": chunk["layers"], "ranges": chunk["ranges"], "a2a_wire_ms": wire}
        entry["a2a_hidden_ms"] = max(0.0, wire - exposed)
        if "hidden_ms" in chunk:
            entry |= {
                "predicted_a2a_ms": chunk["a2a_ms"]["partitioned"],
                "predicted_hidden_ms": chunk["hidden_ms"]["partitioned"],
                "predicted_ms": chunk["predicted_ms"],
            }
        return entry


def as_text(report: dict) -> str:
    """The report as the log shows it (ms a step unless said otherwise)."""
    first, last = report["iterations"]
    lines = [
        f"--overlap-report, iterations {first}-{last} (this rank, ms a step; wire: the crossing bytes' link time, "
        f"hidden: 1 - exposed / wire):",
        f"  {'kind':<18} {'wire':>9} {'exposed':>9} {'skew':>9} {'transfer':>9} {'hidden':>7}",
    ]
    for name, k in [*report["kinds"].items(), ("all", report)]:
        figures = "".join(f" {k[figure]:>9.1f}" for figure in KIND_FIGURES)
        lines.append(f"  {name:<18}{figures} {k['hidden']:>7.1%}")
    for layer, entry in report["layers"].items():
        planned = ""
        if "degrees" in entry:
            forward, backward = entry["degrees"]
            predicted = entry["predicted_ms"]
            planned = (
                f"degrees {forward}/{backward} (predicted forward {predicted['forward']:.1f}, "
                f"backward {predicted['backward']:.1f} ms a micro-batch); "
            )
        lines.append(
            f"  MoE layer {layer}: {planned}all-to-alls {entry['a2a_exposed_ms']:.1f} exposed "
            f"({entry['a2a_skew_ms']:.1f} skew) of {entry['a2a_wire_ms']:.1f} on the wire, {entry['hidden']:.1%} hidden"
        )
    for chunk in report["partition"]:
        ranges = ", ".join(f"{a}-{b} in {k}" for a, b, k in chunk["ranges"]) or "none"
        measured = f"{chunk['a2a_hidden_ms']:.1f} of {chunk['a2a_wire_ms']:.1f}"
        if "predicted_hidden_ms" in chunk:
            predicted = f"{chunk['predicted_hidden_ms']:.1f} of {chunk['predicted_a2a_ms']:.1f}"
            compared = f"predicted {predicted}, measured {measured}"
        else:
            compared = f"measured {measured} (no plan: pieces given)"
        lines.append(
            f"  operator partition, layers {chunk['layers'][0]}-{chunk['layers'][1]} ({ranges} pieces): "
            f"all-to-all ms hidden a micro-batch: {compared}"
        )
    if (choice := report.get("choice")) is not None:
        measured = "not timed" if choice["step_ms"] is None else f"measured {choice['step_ms']:.1f} (median)"
        lines.append(
            f"  overlap choice: {', '.join(choice['on']) or 'none'} on; step predicted "
            f"{choice['predicted_step_ms']:.1f} (with none: {choice['predicted_none_ms']:.1f}), {measured}"
        )
    if (grad := report.get("grad_reduce")) is not None:
        lines.append(
            f"  gradient partition: exposed reduction predicted {grad['predicted_exposed_ms']:.1f}, measured "
            f"{grad['exposed_ms']:.1f} (of {grad['wire_ms']:.1f} on the wire)"
        )
    return "\n".join(lines)
