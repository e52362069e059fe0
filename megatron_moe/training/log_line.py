"""What a logged iteration says: its full record (a JSON object), and the short console line made from it.

The record holds every figure of the interval (`TrainingLogger._emit`): the console shows it whole with
`--log-format json`, and it is appended to `log.jsonl` in --tensorboard-dir either way (`jsonl_path`). The text line
(`short_line`) keeps what a person watching a run acts on, so that it fits a terminal:

    iteration  50/200 | lm loss: 6.1902 | grad norm: 0.4123 | 729 ms | 2809 tok/s | comm 6.2% | ETA 0:01:49

lm loss (the mean of the interval's steps; then each `mtp_N loss` with --mtp-num-layers), grad norm (the last
step's), the mean step time, tokens per second (47.5k, 1.23M above 10,000), the exposed communication's share of
the step (the time the compute waited for it; with the communication timers), the time left, and `skipped N` when
steps were skipped: at most 115 characters with 6-digit iteration counts (and no skipped steps or MTP), about 120
with the log's timestamp for the demo's. MFU, the MoE figures, memory and the communication's breakdown are in
the record, with losses and norms at full precision (the equivalence tests read them there).
"""

from __future__ import annotations

import json
import os
import re

from megatron_moe.comm.timers import SUMMARY_KINDS, hidden_share

JSONL_NAME = "log.jsonl"
"""The JSON-lines file of the run's records, in --tensorboard-dir: beside the event files, which TensorBoard reads
without minding it (not in --save: a checkpoint directory holds checkpoints only)."""

MTP_LOSS = re.compile(r"mtp_\d+ loss")
"""Multi-token prediction's per-layer losses in a record (Megatron-LM's names; training/mtp_metrics.py)."""

COMM_FIGURES = ("step_ms", "exposed_ms", "wire_ms", "skew_ms", "transfer_ms")
"""The communication timers' figures a step gives the log (`TrainingLogger.step`'s `comm`), in order."""

EXPOSED_GROUPS = {
    "a2a": ("a2a_",),
    "esp": ("esp_",),
    "shadow": ("shadow",),
    "dp_grad_reduce": ("dp_grad_reduce",),
    "tp": ("tp",),
    "pp_p2p": ("pp_p2p",),
    "other": ("other",),
}
"""The exposed-communication breakdown's groups of timer kinds (name -> kind prefixes): every summary kind is in
exactly one, so the parts add up to the total."""
assert all(sum(kind.startswith(p) for p in EXPOSED_GROUPS.values()) == 1 for kind in SUMMARY_KINDS)


def jsonl_path(tensorboard_dir: str | None) -> str | None:
    """Where the records go: `log.jsonl` beside the TensorBoard event files (None: no --tensorboard-dir, no
    file; --log-format json prints them)."""
    return os.path.join(tensorboard_dir, JSONL_NAME) if tensorboard_dir else None


def exposed_by_group(exposed_ms: dict[str, float]) -> dict[str, float]:
    """A step's exposed ms per `EXPOSED_GROUPS` entry from the timers' exposed ms per kind."""
    return {
        name: sum(ms for kind, ms in exposed_ms.items() if kind.startswith(prefixes))
        for name, prefixes in EXPOSED_GROUPS.items()
    }


def comm_record(
    comm: dict[str, float], kinds: dict[str, float], layers: dict[int, list[float]]
) -> dict[str, object] | None:
    """The interval's communication, per step: `comm` the sums of `COMM_FIGURES` and "steps"; `kinds` the exposed
    ms per group (`exposed_by_group`, summed); `layers` MoE layer -> [exposed ms, wire ms] summed. None: timers
    off. `exposed_ms_by_kind` holds every group that waited at all (its values add up to `exposed_ms`)."""
    steps = comm["steps"]
    if steps == 0:
        return None
    step_ms, exposed_ms, wire_ms = comm["step_ms"], comm["exposed_ms"], comm["wire_ms"]
    return {
        "exposed_ms": exposed_ms / steps,
        "exposed_percent": 100.0 * exposed_ms / step_ms if step_ms > 0 else 0.0,
        "skew_ms": comm["skew_ms"] / steps,
        "transfer_ms": comm["transfer_ms"] / steps,
        "wire_ms": wire_ms / steps,
        "hidden_percent": 100.0 * hidden_share(exposed_ms, wire_ms),
        "exposed_ms_by_kind": {name: ms / steps for name, ms in kinds.items() if ms > 0},
        "hidden_percent_by_moe_layer": {
            str(layer): 100.0 * hidden_share(exposed, wire) for layer, (exposed, wire) in sorted(layers.items())
        },
    }


def breakdown_text(comm: dict[str, object]) -> str:
    """`exposed comm: 19.2 ms per step (1.4% of step) = pp_p2p 12.0 + tp 7.0 + dp_grad_reduce 0.2 ms` from a
    `comm_record`: every kind that waited, largest first, so the parts add up to the total (to rounding)."""
    parts = sorted(comm["exposed_ms_by_kind"].items(), key=lambda item: -item[1])
    text = f"exposed comm: {comm['exposed_ms']:.1f} ms per step ({comm['exposed_percent']:.1f}% of step)"
    if parts:
        text += " = " + " + ".join(f"{name} {ms:.1f}" for name, ms in parts) + " ms"
    return text + f"; skew {comm['skew_ms']:.1f} ms, {comm['hidden_percent']:.0f}% of the wire time hidden"


def short_line(record: dict) -> str:
    """The console's iteration line from a record (module docstring)."""
    width = len(str(record["train_iters"]))
    parts = [f"iteration {record['iteration']:>{width}d}/{record['train_iters']:d}"]
    if record.get("lm loss") is not None:
        parts.append(f"lm loss: {record['lm loss']:.4f}")
    parts += [f"{name}: {record[name]:.4f}" for name in record if MTP_LOSS.fullmatch(name)]  # Megatron-LM's
    if record.get("grad_norm") is not None:
        parts.append(f"grad norm: {record['grad_norm']:.4g}")
    step_ms = record["ms_per_iteration"]
    parts += [f"{step_ms:.0f} ms" if step_ms >= 10 else f"{step_ms:.1f} ms", f"{_count(record['tokens_per_s'])} tok/s"]
    if record.get("comm") is not None:
        parts.append(f"comm {record['comm']['exposed_percent']:.1f}%")
    parts.append(f"ETA {hms(record['eta_s'])}")
    if record.get("skipped_iterations"):
        parts.append(f"skipped {record['skipped_iterations']}")
    return " | ".join(parts)


def _count(value: float) -> str:
    """2809, 47.5k, 1.23M."""
    if value < 1e4:
        return f"{value:.0f}"
    return f"{value / 1e3:.1f}k" if value < 1e6 else f"{value / 1e6:.2f}M"


def as_json(record: dict) -> str:
    """One line of JSON. A non-finite figure (a diverged loss) is written as NaN / Infinity, which Python's
    json reads back (null would lose which)."""
    return json.dumps(record, separators=(", ", ": "))


def hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
