"""Which weight-gradient (dW) work runs under which backward all-to-all: Lancet's Algorithm 1, as pure code.

Input: a profile of one micro-batch's backward pass, the `Event`s in the order they happened (a module's dW
became runnable, or a backward all-to-all started). Output: a `WgradSchedule`, `under[wgrad key] = a2a key`;
the queue (`megatron_moe.overlap.wgrad_queue`) starts that all-to-all, runs the dW assigned to it, then waits.
A dW not in the schedule runs at its natural place.
Invariants: an item is a module's whole dW (`L{layer}.{name}`); a dW is a candidate only for an all-to-all after
it in the same pass; every rank of a stage makes the same schedule (`canonical_order`, times agreed by `agree`);
`max_mb` leaves a dW at its natural place where queueing it would pass the cap. Deviations from the paper:
docs/internals/overlap.md ("Lancet's dW schedule").
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Iterable, Sequence

import torch

from megatron_moe.comm.core import host_read
from megatron_moe.comm.training import agree_wgrad_profile
from megatron_moe.config.fields import require
from megatron_moe.platform import current_platform

EVENT_KINDS = ("wgrad", "a2a")
WGRAD_NAMES = ("attn_qkv", "attn_proj", "mlp_fc1", "mlp_fc2", "experts", "shared_expert", "router", "output")
"""`output`: the untied LM head, keyed by the last layer ("L{num_layers}.output")."""
BACKWARD_NAMES = ("output", "mlp_fc2", "mlp_fc1", "shared_expert", "experts", "router", "attn_proj", "attn_qkv")
"""`WGRAD_NAMES` in the order a layer's backward makes them, the order `canonical_order` gives them."""
A2A_NAMES = ("combine", "dispatch")
POLICIES = ("off", "greedy", "all-under-next-a2a")
COVERED_MS = 1e-9
"""An all-to-all's unhidden remainder at most this (ms) counts as covered: 1 - 0.7 - 0.3 is 5.6e-17, not > 0."""

_KEY = re.compile(r"L(\d+)\.(\w+)")


def parse_key(key: str) -> tuple[int, str]:
    """'L{layer}.{name}' -> (layer, name); ValueError for anything else."""
    match = _KEY.fullmatch(key)
    if match is None:
        raise ValueError(f"event key {key!r}: expected 'L{{layer}}.{{name}}', e.g. 'L3.experts' or 'L3.combine'")
    return int(match.group(1)), match.group(2)


@dataclasses.dataclass(frozen=True)
class Event:
    """One entry of a profiled backward pass of one micro-batch, in the order it happened."""

    kind: str
    """'wgrad' (a module's weight-gradient GEMMs became runnable: its dX just ran) or 'a2a' (a backward all-to-all
    started)."""
    key: str
    """wgrad: 'L{layer}.{name}' with name in `WGRAD_NAMES`; a2a: 'L{layer}.combine' / 'L{layer}.dispatch'."""
    ms: float
    """wgrad: its dW GEMMs' time; a2a: its time when nothing overlaps it (all exposed)."""
    held_mb: float = 0.0
    """wgrad: MiB its closure holds while queued (its inputs and output gradient)."""

    def __post_init__(self):
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"event {self.key!r}: kind {self.kind!r}; one of {EVENT_KINDS}")
        names = WGRAD_NAMES if self.kind == "wgrad" else A2A_NAMES
        layer, name = parse_key(self.key)
        if name not in names or layer < 1:
            raise ValueError(f"{self.kind} event key {self.key!r}: expected L<layer >= 1>.<name>, name one of {names}")
        if not (self.ms >= 0 and self.held_mb >= 0):  # also refuses NaN
            raise ValueError(f"event {self.key!r}: ms={self.ms}, held_mb={self.held_mb}; both must be >= 0")


def canonical_order(events: Sequence[Event]) -> list[Event]:
    """`events` with the wgrad events between two a2a events sorted by layer, from the last, then
    `BACKWARD_NAMES`; the a2a events stay where they are.

    Which dW a pass makes between two all-to-alls is the model's; the order
    they came in between is the order autograd ran this rank's independent
    branches in (the routed and the shared expert; a rank that received no
    rows runs its experts as other nodes). The schedule must not depend on it:
    the cap's walk (`_queued_mb`) and best-fit's ties read the order."""
    ordered: list[Event] = []
    window: list[Event] = []
    for event in events:
        if event.kind == "wgrad":
            window.append(event)
            continue
        ordered += sorted(window, key=_backward_position)
        window = []
        ordered.append(event)
    return ordered + sorted(window, key=_backward_position)


def _backward_position(event: Event) -> tuple[int, int]:
    layer, name = parse_key(event.key)
    return -layer, BACKWARD_NAMES.index(name)


def _check_unique(events: Sequence[Event]) -> None:
    seen = set()
    for i, event in enumerate(events):
        if event.key in seen:
            raise ValueError(f"event {i}: key {event.key!r} appears twice in one pass; keys must be unique")
        seen.add(event.key)


def best_fit_greedy(events: Sequence[Event]) -> dict[str, str]:
    """Lancet's Algorithm 1, as written: {wgrad key: the a2a key it runs under}.

    For each a2a in order, t_u = its time; while t_u > 0 and a candidate is left:
    pick the candidate j minimising |t_u - t_j| (ties: the earlier event),
    t_u -= t_j (t_u may go below 0: the paper allows the overshoot), assign j
    to this a2a and mark it used. Candidates of an a2a: the wgrad events before
    it in the pass, not yet used.
    """
    _check_unique(events)
    candidates: list[Event] = []  # in event order: the tie-break is the lowest index
    under: dict[str, str] = {}
    for event in events:
        if event.kind == "wgrad":
            candidates.append(event)
            continue
        unhidden_ms = event.ms
        while unhidden_ms > COVERED_MS and candidates:
            best = min(range(len(candidates)), key=lambda i: (abs(unhidden_ms - candidates[i].ms), i))
            chosen = candidates.pop(best)
            unhidden_ms -= chosen.ms
            under[chosen.key] = event.key
    return under


def all_under_next_a2a(events: Sequence[Event]) -> dict[str, str]:
    """Every wgrad under the first a2a after it; those after the last a2a run at their natural place."""
    _check_unique(events)
    pending: list[str] = []
    under: dict[str, str] = {}
    for event in events:
        if event.kind == "wgrad":
            pending.append(event.key)
        else:
            under.update((key, event.key) for key in pending)
            pending.clear()
    return under


def _queued_mb(events: Sequence[Event], under: dict[str, str], max_mb: float | None) -> tuple[dict[str, str], float]:
    """Walk the events holding each assigned wgrad's MiB from its event until its a2a runs it: (the assignments that
    keep the MiB queued at once within `max_mb` (None: all), the peak MiB queued)."""
    kept: dict[str, str] = {}
    queued: dict[str, float] = {}  # wgrad key -> MiB, while it waits for its a2a
    peak = 0.0
    for event in events:
        if event.kind == "wgrad" and event.key in under:
            if max_mb is not None and math.fsum([*queued.values(), event.held_mb]) > max_mb:
                continue  # left at its natural place: runs at once, holds nothing
            kept[event.key] = under[event.key]
            queued[event.key] = event.held_mb
            peak = max(peak, math.fsum(queued.values()))
        elif event.kind == "a2a":
            for key in [k for k in queued if kept[k] == event.key]:
                del queued[key]
    return kept, peak


@dataclasses.dataclass(frozen=True)
class WgradSchedule:
    """Which dW runs under which backward all-to-all, and the profile it was made from."""

    policy: str
    """One of `POLICIES`."""
    under: dict[str, str]
    """wgrad key -> the a2a key it runs under; a key not here runs at its natural place."""
    events: tuple[Event, ...]
    """The (agreed) profile the schedule was made from."""

    def __post_init__(self):
        require(self.policy in POLICIES, "--overlap-wgrad", self.policy, f"one of {', '.join(POLICIES)}")
        _check_unique(self.events)
        position = {e.key: i for i, e in enumerate(self.events)}
        for wgrad, a2a in self.under.items():
            ok = wgrad in position and a2a in position and self.events[position[wgrad]].kind == "wgrad"
            if not (ok and self.events[position[a2a]].kind == "a2a" and position[wgrad] < position[a2a]):
                raise ValueError(f"schedule: {wgrad!r} under {a2a!r}: needs a wgrad event before an a2a event")

    def a2a_events(self) -> list[Event]:
        return [e for e in self.events if e.kind == "a2a"]

    def items_under(self, a2a_key: str) -> list[str]:
        """The wgrad keys assigned to `a2a_key`, in event order."""
        return [e.key for e in self.events if e.kind == "wgrad" and self.under.get(e.key) == a2a_key]

    def natural(self) -> list[str]:
        """The wgrad keys that run at their natural place, in event order."""
        return [e.key for e in self.events if e.kind == "wgrad" and e.key not in self.under]

    def predicted_hidden_ms(self) -> dict[str, float]:
        """Per a2a: min(its time, the sum of its items' times)."""
        ms = {e.key: e.ms for e in self.events}
        return {a.key: min(a.ms, math.fsum(ms[k] for k in self.items_under(a.key))) for a in self.a2a_events()}

    def predicted_exposed_ms(self) -> dict[str, float]:
        """Per a2a: its time less the hidden part."""
        hidden = self.predicted_hidden_ms()
        return {a.key: a.ms - hidden[a.key] for a in self.a2a_events()}

    def held_mb_peak(self) -> float:
        """The most MiB queued at once, walking the events (a dW holds from its event until its a2a runs it)."""
        return _queued_mb(self.events, self.under, None)[1]

    def report(self, measured_hidden_ms: dict[str, float] | None = None) -> str:
        """A readable table: per a2a, its time, predicted hidden / exposed (and the measured hidden time, when
        given), the dW under it (ms); then totals, the dW at their natural place and the held-memory peak."""
        return _report(self, measured_hidden_ms)

    def to_json(self) -> dict:
        events = [dataclasses.asdict(e) for e in self.events]
        return {"policy": self.policy, "under": dict(self.under), "events": events}

    @classmethod
    def from_json(cls, data: dict) -> WgradSchedule:
        return cls(policy=data["policy"], under=dict(data["under"]), events=tuple(Event(**e) for e in data["events"]))


def _report(schedule: WgradSchedule, measured: dict[str, float] | None) -> str:
    ms = {e.key: e.ms for e in schedule.events}
    hidden, exposed = schedule.predicted_hidden_ms(), schedule.predicted_exposed_ms()
    extra = f" {'measured':>9}" if measured is not None else ""
    lines = [
        f"dW overlap schedule, policy {schedule.policy}: {len(schedule.under)} of "
        f"{len(schedule.under) + len(schedule.natural())} dW "
        f"under {len(schedule.a2a_events())} backward all-to-alls (predicted from the profile; ms)",
        f"{'all-to-all':<14} {'a2a ms':>8} {'hidden':>8} {'exposed':>8}{extra}  dW under it (ms)",
    ]
    for a2a in schedule.a2a_events():
        items = ", ".join(f"{k} ({ms[k]:.2f})" for k in schedule.items_under(a2a.key)) or "-"
        seen = f" {measured.get(a2a.key, float('nan')):>9.2f}" if measured is not None else ""
        lines.append(f"{a2a.key:<14} {a2a.ms:>8.2f} {hidden[a2a.key]:>8.2f} {exposed[a2a.key]:>8.2f}{seen}  {items}")
    total = math.fsum(a.ms for a in schedule.a2a_events())
    seen = f" {math.fsum(measured.values()):>9.2f}" if measured is not None else ""
    lines.append(
        f"{'total':<14} {total:>8.2f} {math.fsum(hidden.values()):>8.2f} {math.fsum(exposed.values()):>8.2f}{seen}"
    )
    natural = ", ".join(f"{k} ({ms[k]:.2f})" for k in schedule.natural()) or "-"
    lines.append(f"at their natural place: {natural}")
    lines.append(f"held while queued: peak {schedule.held_mb_peak():.1f} MiB")
    return "\n".join(lines)


def make_wgrad_schedule(policy: str, events: Iterable[Event], max_mb: float | None = None) -> WgradSchedule:
    """The schedule of `policy` (one of `POLICIES`; "off": empty) for a pass's `events`.

    Memory cap: walking the events in order, a wgrad whose assignment would make
    the MiB queued at once exceed `max_mb` is left at its natural place
    (deterministic, so every rank makes the same schedule from the same events).
    """
    require(policy in POLICIES, "--overlap-wgrad", policy, f"one of {', '.join(POLICIES)}")
    require(max_mb is None or max_mb >= 0, "--overlap-wgrad-max-mb", max_mb, "must be >= 0 (unset: no cap)")
    events = tuple(events)
    if policy == "greedy":
        under = best_fit_greedy(events)
    elif policy == "all-under-next-a2a":
        under = all_under_next_a2a(events)
    else:
        under = {}
    under, _ = _queued_mb(events, under, max_mb)
    return WgradSchedule(policy=policy, under=under, events=events)


def merge_passes(passes: Sequence[Sequence[Event]]) -> list[Event]:
    """Several profiled passes (micro-batches, steps) of the same structure -> one: each event's ms the median over
    the passes, its held_mb the max (the cap must hold for the largest). ValueError naming the first difference
    when the structure (kinds and keys, in order) differs."""
    if not passes:
        raise ValueError("merge_passes: no profiled pass to merge")
    first = [(e.kind, e.key) for e in passes[0]]
    for n, events in enumerate(passes[1:], start=1):
        shape = [(e.kind, e.key) for e in events]
        if shape != first:
            i = next((i for i, (a, b) in enumerate(zip(first, shape)) if a != b), min(len(first), len(shape)))
            raise ValueError(
                f"profiled pass {n} differs from pass 0 at event {i}: {_entry(shape, i)} vs {_entry(first, i)}"
            )
    return [
        dataclasses.replace(
            event,
            ms=statistics.median(p[i].ms for p in passes),
            held_mb=max(p[i].held_mb for p in passes),
        )
        for i, event in enumerate(passes[0])
    ]


def _entry(shape: list[tuple[str, str]], i: int) -> str:
    return f"{shape[i][0]} {shape[i][1]!r}" if i < len(shape) else "the end of the pass"


def agree(events: Sequence[Event], num_layers: int, group=None, device: torch.device | None = None) -> list[Event]:
    """The same profile on every rank of `group` (None: the world): this rank's events, in the same order, with each
    ms and held_mb the max over the ranks that hold that key.

    Ranks of different pipeline stages hold different layers, so every rank
    packs its events into one fixed [num_layers, names, 4] table indexed by
    (global layer, name) over `WGRAD_NAMES + A2A_NAMES` (zeros where it holds
    nothing) and all ranks join one MAX all-reduce: none can hang, and a key's
    figure is the slowest rank's. Keys must be unique within the pass.

    The same reduction checks that the ranks holding a key agree on the pass's
    structure (else their schedules, and the order of their reductions, would
    differ): each key also carries s = (events in the pass) x 2^20 + its
    position, and -s (-inf where a rank holds nothing); max s != min s is a
    ValueError on every rank that holds the key.
    """
    _check_unique(events)
    names = WGRAD_NAMES + A2A_NAMES
    device = current_platform().device if device is None else device  # where the backend reduces
    table = torch.zeros(num_layers, len(names), 4, dtype=torch.float64, device=device)
    table[..., 2:] = -math.inf
    slots = []
    for position, event in enumerate(events):
        layer, name = parse_key(event.key)
        if not 1 <= layer <= num_layers:
            raise ValueError(f"event {event.key!r}: layer {layer} is outside 1..{num_layers} (num_layers)")
        slots.append((layer - 1, names.index(name)))
        where = float(len(events) * _POSITIONS + position)
        table[slots[-1]] = torch.tensor([event.ms, event.held_mb, where, -where], dtype=torch.float64)
    agree_wgrad_profile(table, group)
    with host_read("overlap-wgrad profile"):
        agreed = table.cpu().tolist()
    for position, (event, (layer, name)) in enumerate(zip(events, slots)):
        most, least = agreed[layer][name][2], -agreed[layer][name][3]
        if most != least:
            raise ValueError(
                f"profiled pass: {event.key!r} is event {position} of {len(events)} here, not on every rank that "
                "holds it; the ranks of a pipeline stage must profile the same dW and all-to-alls in the same "
                "order, or their schedules (and the order of their gradient reductions) would differ"
            )
    return [
        dataclasses.replace(event, ms=agreed[layer][name][0], held_mb=agreed[layer][name][1])
        for event, (layer, name) in zip(events, slots)
    ]


_POSITIONS = float(1 << 20)
"""`agree`'s structure check: positions in a pass are below this."""
