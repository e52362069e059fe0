"""Lancet at run time: weight-gradient GEMMs queued in backward and run under the backward all-to-alls.

One `WgradQueue` per process, the `weight_grad_store` of every deferrable module (`OverlapRuntime.attach`).
Inputs: each module's dW closure (`put`, after its dX ran); each backward all-to-all (`run_under`, through the
runtime); the policy and its schedule (`wgrad_schedule`: `all-under-next-a2a`, or `greedy`, profiled in iteration
`PROFILE_ITERATION`, agreed over the ranks, planned from the next). Outputs: each weight's `.grad` and DDP's hook
for it (`deliver`: megatron-core's `main_grad.add_` and bucket readiness, bit-identical to no deferral); `stats`.
Invariants: a closure runs under the all-to-all its schedule names, at its natural place, or when autograd's
backward of the micro-batch ends (`flush`), never later; where DDP hears of a weight gradient follows from the
policy and schedule alone, the same on every rank of a stage; the memory cap (`--overlap-wgrad-max-mb`) bounds
this rank's bytes by running a closure's GEMMs early (`accumulate_now`) while its hook still runs where planned
(`announce`), so no collective is added. Why: docs/internals/overlap.md ("Lancet's weight-gradient queue").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch

from megatron_moe.comm.core import Collective, CommHandle
from megatron_moe.moe.weight_grad import DeferrableWeights, WeightGrad
from megatron_moe.overlap import wgrad_schedule
from megatron_moe.platform.timing import comm_stamps

MIB = float(1 << 20)
PROFILE_ITERATION = 2
"""The iteration `greedy` times (the first warms up allocators and kernels); its schedule runs from the next one."""


def a2a_key(record: Collective) -> str:
    """The schedule's name for a backward all-to-all: "L{layer}.combine" / "L{layer}.dispatch"."""
    return f"L{record.layer}.{record.kind.removeprefix('a2a_')}"


def held_bytes(fn: Callable) -> int:
    """Bytes of the distinct tensor storages a closure holds (through nested closures, lists and tuples);
    parameters are not counted (they live on anyway)."""
    seen: dict[int, int] = {}

    def visit(obj) -> None:
        if isinstance(obj, torch.nn.Parameter):
            return
        if torch.is_tensor(obj):
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)
        elif callable(obj) and getattr(obj, "__closure__", None):
            for cell in obj.__closure__:
                visit(cell.cell_contents)

    visit(fn)
    return sum(seen.values())


@dataclasses.dataclass
class _Item:
    module: DeferrableWeights
    weight_grad: WeightGrad | None
    """None once its GEMMs ran over the memory cap: only DDP's hooks for `accumulated` wait."""
    nbytes: int
    accumulated: tuple[tuple[torch.nn.Parameter, bool], ...] = ()
    """(parameter, its `grad_added_to_main_grad` before) whose gradient is in main_grad, its hook still to run."""


class _ModuleStore:
    """One deferrable module's `WeightGradStore`: hands its closures to the queue, which owns the gradients."""

    defers = True

    def __init__(self, queue: WgradQueue, module: DeferrableWeights):
        self.queue, self.module = queue, module

    def put(self, weight_grad: WeightGrad, outs: tuple) -> None:
        assert all(out is None for out in outs), "a deferred closure makes its own gradients"
        self.queue.put(_Item(self.module, weight_grad, held_bytes(weight_grad)))
        return None


class WgradQueue:
    """The weight-gradient closures of one process's deferrable modules; see the module docstring."""

    def __init__(self, policy: str, *, max_mb: float | None, num_layers: int, report: bool = False):
        assert policy in wgrad_schedule.POLICIES and policy != "off", policy
        self.policy, self.max_mb, self.num_layers, self.report = policy, max_mb, num_layers, report
        self.schedule: wgrad_schedule.WgradSchedule | None = None
        self.iteration = 0
        self._pending: list[tuple[str, _Item]] = []  # (the all-to-all key it waits for, the item)
        self._pending_bytes = 0
        self._flush_queued = False
        self._stamps = comm_stamps()
        self._passes: list[list[tuple]] = []  # while profiling: per pass (kind, key, start, end, held MiB)
        self.counts = {"under_a2a": 0, "natural": 0, "at_backward_end": 0, "over_cap": 0}
        """Closures run in this iteration: under an all-to-all, at their natural place, at the backward's end; and
        queued ones whose GEMMs ran at once because holding them would pass the memory cap (DDP's hook for them
        still ran where planned)."""
        self.peak_held_bytes = 0
        """The most bytes queued closures held at once in this iteration."""

    # ------------------------------------------------------------------ the installer's side

    def store_for(self, module: DeferrableWeights) -> _ModuleStore:
        return _ModuleStore(self, module)

    def first_planned_iteration(self) -> bool:
        """True in the first iteration that ran under greedy's schedule (the one the report measures)."""
        return self.schedule is not None and self.iteration == PROFILE_ITERATION + 1

    @property
    def profiling(self) -> bool:
        return self.policy == "greedy" and self.iteration == PROFILE_ITERATION

    def start_iteration(self, iteration: int) -> None:
        """Called before each training iteration (1-based) on every rank."""
        self.iteration, self.peak_held_bytes = iteration, 0
        self.counts = dict.fromkeys(self.counts, 0)
        # A backward that raised never ran its engine callback (`flush`): drop its closures, so that the next
        # backward queues its own flush instead of leaving every closure pending.
        self._pending, self._pending_bytes, self._flush_queued = [], 0, False

    def stats(self) -> dict:
        """This iteration's figures: closures per place they ran, the held-memory peak (MiB), the schedule in force."""
        figures = {**self.counts, "peak_held_mb": round(self.peak_held_bytes / MIB, 3), "policy": self.policy}
        if (
            self.schedule is not None
        ):  # greedy's profile: what there is to hide, what dW is there, what the schedule hides
            events = self.schedule.events
            figures["planned"] = len(self.schedule.under)
            figures["plan_a2a_ms"] = round(sum(e.ms for e in events if e.kind == "a2a"), 3)
            figures["plan_wgrad_ms"] = round(sum(e.ms for e in events if e.kind == "wgrad"), 3)
            figures["plan_hidden_ms"] = round(sum(self.schedule.predicted_hidden_ms().values()), 3)
        return figures

    def end_iteration(self) -> None:
        """Called after each training iteration on every rank (collective after the profiled one)."""
        if self.profiling:
            self.schedule = self._schedule_from_profile()

    # ------------------------------------------------------------------ 1. put

    def _waits_for(self, key: str) -> str | None:
        """The all-to-all where DDP hears of `key`'s weight gradients, or None: now. From the policy and the schedule
        only (no schedule yet, or a key it leaves out: None on every rank), never from this rank's bytes: see the
        module docstring's invariant."""
        if self.policy == "all-under-next-a2a":
            return "next"
        return None if self.schedule is None else self.schedule.under.get(key)

    def _over_cap(self, nbytes: int) -> bool:
        """Would queueing `nbytes` more pass this rank's cap? Decides only when this rank's GEMMs run."""
        return self.max_mb is not None and (self._pending_bytes + nbytes) / MIB > self.max_mb

    def put(self, item: _Item) -> None:
        self._flush_at_backward_end()
        key = item.module.store_key
        under = self._waits_for(key)
        if under is None:
            self.counts["natural"] += 1
            self._run(item, profile_key=key if self.profiling else None)
            return
        if self._over_cap(item.nbytes):
            self.counts["over_cap"] += 1
            accumulated = accumulate_now(item.module, item.weight_grad())
            if not accumulated:  # no DDP hook waits for it (no DDP): nothing left to queue
                return
            item = _Item(item.module, None, 0, accumulated)
        self._pending.append((under, item))
        self._pending_bytes += item.nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self._pending_bytes)

    # ------------------------------------------------------------------ 2. under an all-to-all

    def run_under(self, record: Collective, handle: CommHandle):
        """A backward all-to-all has started: run the closures waiting for it, then wait for it."""
        key = a2a_key(record)
        start = self._stamps.stamp() if self.profiling else None
        if self._pending:
            mine = [item for under, item in self._pending if under in (key, "next")]
            self._pending = [(under, item) for under, item in self._pending if under not in (key, "next")]
            for item in mine:
                self._pending_bytes -= item.nbytes
                if item.weight_grad is not None:
                    self.counts["under_a2a"] += 1
                self._run(item)
        received = handle.wait()
        if start is not None:
            self._record("a2a", key, start, self._stamps.stamp(), 0.0)
        return received

    # ------------------------------------------------------------------ 3. the end of a backward pass

    def _flush_at_backward_end(self) -> None:
        """Once per backward pass: run `flush` when autograd's engine finishes it."""
        if not self._flush_queued and torch._C._current_graph_task_id() != -1:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self._flush_queued = True

    def flush(self) -> None:
        """Run everything still queued (in the order it was put)."""
        self._flush_queued = False
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        for _, item in pending:
            if item.weight_grad is not None:
                self.counts["at_backward_end"] += 1
            self._run(item)
        if self.profiling:
            self._passes.append([])

    # ------------------------------------------------------------------ running a closure

    def _run(self, item: _Item, profile_key: str | None = None) -> None:
        if item.weight_grad is None:  # its GEMMs ran over the cap: DDP hears of it here, as on every other rank
            announce(item.module, item.accumulated)
            return
        start = self._stamps.stamp() if profile_key else None
        grads = item.weight_grad()
        if start is not None:
            self._record("wgrad", profile_key, start, self._stamps.stamp(), item.nbytes / MIB)
        deliver(item.module, grads)

    # ------------------------------------------------------------------ profile -> schedule

    def _record(self, kind: str, key: str, start, end, held_mb: float) -> None:
        if not self._passes:
            self._passes.append([])
        self._passes[-1].append((kind, key, start, end, held_mb))

    def _schedule_from_profile(self) -> wgrad_schedule.WgradSchedule:
        passes = [p for p in self._passes if p]
        self._passes = []
        if passes:
            self._stamps.settle(passes[-1][-1][3])
        events = [wgrad_schedule.canonical_order(_merge_repeats([self._event(*e) for e in one])) for one in passes]
        # Under the interleaved pipeline each model chunk's backward is a pass of its own layers: passes of the same
        # chunk are merged, and each chunk's dW are planned under its own all-to-alls (a pass flushes at its end).
        kinds = _passes_by_structure(events)
        merged = [wgrad_schedule.merge_passes(same) for same in kinds]
        agreed = wgrad_schedule.agree([event for one in merged for event in one], self.num_layers)  # one collective
        schedules, start = [], 0
        for one in merged:
            schedules.append(
                wgrad_schedule.make_wgrad_schedule(self.policy, agreed[start : start + len(one)], self.max_mb)
            )
            start += len(one)
        under = {key: a2a for schedule in schedules for key, a2a in schedule.under.items()}
        return wgrad_schedule.WgradSchedule(policy=self.policy, under=under, events=tuple(agreed))

    def _event(self, kind, key, start, end, held_mb) -> wgrad_schedule.Event:
        return wgrad_schedule.Event(kind, key, self._stamps.elapsed_ms(start, end), held_mb)


def _passes_by_structure(passes: list[list[wgrad_schedule.Event]]) -> list[list[list[wgrad_schedule.Event]]]:
    """Profiled passes grouped by their structure (kinds and keys in order), groups in order of first appearance:
    one group without virtual pipeline stages, one per model chunk with them."""
    groups: dict[tuple, list[list[wgrad_schedule.Event]]] = {}
    for one in passes:
        groups.setdefault(tuple((e.kind, e.key) for e in one), []).append(one)
    return list(groups.values())


def _merge_repeats(events: list[wgrad_schedule.Event]) -> list[wgrad_schedule.Event]:
    """One event per key: a module whose closures came in several puts in one pass is one item (times added)."""
    merged: dict[str, wgrad_schedule.Event] = {}
    for event in events:
        if event.key in merged:
            first = merged[event.key]
            merged[event.key] = dataclasses.replace(
                first, ms=first.ms + event.ms, held_mb=first.held_mb + event.held_mb
            )
        else:
            merged[event.key] = event
    return list(merged.values())


def deliver(module: DeferrableWeights, grads: Iterable[torch.Tensor | None]) -> None:
    """Hand weight gradients over as autograd would: accumulate into `.grad`, then DDP's hook (main_grad)."""
    for param, grad in zip(module.deferred_params(), grads):
        if grad is None:
            continue
        param.grad = grad if param.grad is None else param.grad + grad
        hook = module.wgrad_hook(param)
        if hook is not None:
            hook()


def accumulate_now(
    module: DeferrableWeights, grads: Iterable[torch.Tensor | None]
) -> tuple[tuple[torch.nn.Parameter, bool], ...]:
    """Weight gradients into `main_grad` now, as DDP's hook adds them, flagged `grad_added_to_main_grad` so that
    the hook (`announce`, later) only marks them ready; returns (parameter, the flag before) of those. A parameter
    without DDP's hook gets its `.grad` at once: nothing collective waits for it."""
    later = []
    for param, grad in zip(module.deferred_params(), grads):
        if grad is None:
            continue
        total = grad if param.grad is None else param.grad + grad
        if module.wgrad_hook(param) is None:
            param.grad = total
            continue
        param.grad = None
        param.main_grad.add_(total)  # DDP's hook: main_grad.add_(param.grad.data)
        later.append((param, getattr(param, "grad_added_to_main_grad", False)))
        param.grad_added_to_main_grad = True
    return tuple(later)


def announce(module: DeferrableWeights, accumulated: Iterable[tuple[torch.nn.Parameter, bool]]) -> None:
    """DDP's hook for gradients `accumulate_now` already added: it skips the add (the flag) and marks each ready.
    Its `.grad` must not be None under --overlap-grad-reduce: a zero-stride placeholder, never read."""
    for param, flag_before in accumulated:
        param.grad = torch.zeros((), dtype=param.dtype, device=param.device).expand_as(param)
        module.wgrad_hook(param)()
        param.grad = None
        param.grad_added_to_main_grad = flag_before
