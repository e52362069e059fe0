"""The run's overlap runtime: one object built at set-up, handed to the model once, pulled from at run time.

Holds: Lancet's weight-gradient queue (`wgrad_queue.WgradQueue`, or None), the adaptive gradient partition's
launcher (`grad_reduce.GradReduceLauncher`, or None), the start-up plans (`OverlapPlans`) and the cost model's fits.
Inputs: the queue at construction; `attach` once per model (before megatron-core's DDP wraps it); the launcher,
plans and fits filled in on the runtime afterwards, in any order.
Outputs: `run_under`, every MoE dispatcher's `backward_overlap` (a `comm.BackwardOverlap`); the Trainer's
per-iteration calls (`start_iteration`, `end_iteration`, `stats`, `started`).
Invariant: each dispatcher holds this object for the whole run and reads the queue and launcher only when a
backward all-to-all starts, so nothing depends on the order in which they were set; under an all-to-all of MoE
layer L the launcher releases L's planned bucket groups first, then the queue runs its closures and waits (or the
all-to-all is waited).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megatron_moe.comm.core import Collective, CommHandle
from megatron_moe.moe import handover
from megatron_moe.moe.weight_grad import DeferrableWeights
from megatron_moe.overlap import install
from megatron_moe.overlap.grad_reduce import GradReduceLauncher
from megatron_moe.overlap.wgrad_queue import WgradQueue


@dataclasses.dataclass(frozen=True)
class OverlapPlans:
    """The start-up planners' choices on this rank, as training/__init__.py collects them."""

    degrees: dict = dataclasses.field(default_factory=dict)
    """MoE layer -> cost_model.Schedule (auto degrees); empty when the degrees were given."""
    partition: list = dataclasses.field(default_factory=list)
    """setup.install_operator_partition's figures, one per model chunk that runs pieces or was planned."""
    grad_reduce: object | None = None
    """grad_partition.GradPartition of the adaptive schedule; None with megatron-core's buckets."""
    choice: object | None = None
    """choice.OverlapChoice (--moe-overlap-choice auto); None where the flags were taken as given."""


class OverlapRuntime:
    """See the module docstring. Every field may stay None (that feature off): `run_under` then waits."""

    def __init__(self, wgrad_queue: WgradQueue | None = None):
        self.wgrad_queue = wgrad_queue
        """Lancet's queue (--overlap-wgrad); fixed at construction: the deferrable modules' stores point into it."""
        self.grad_reduce: GradReduceLauncher | None = None
        """The adaptive gradient partition's launcher (--grad-reduce-schedule adaptive), planned after DDP exists."""
        self.plans = OverlapPlans()
        self.fits = None
        """The cost model's fits the communication timers price the crossing bytes with (None: not needed)."""
        self.on_started: Callable[[], None] | None = None
        """Called once, after the first iteration (or a run of none) completed: the profile is saved then."""
        self.job_steps = 0
        """Training iterations this job started (a resumed job counts from its own start)."""

    # ------------------------------------------------------------------ set-up: handed to the model once

    def attach(self, model_chunks: list[torch.nn.Module]) -> list[tuple[str, DeferrableWeights]]:
        """Hand this runtime to every model chunk: with a queue, every deferrable module's weight gradients go
        through it (`install.install_stores`); every MoE dispatcher runs `run_under`. Call once, before wrapping
        the chunks in DDP (with `delay_wgrad_compute` where there is a queue); returns the (key, module) pairs."""
        installed = []
        for chunk in model_chunks:
            if self.wgrad_queue is not None:
                installed += install.install_stores(install.deferrable_modules(chunk), self.wgrad_queue)
            install.set_dispatchers(chunk, self)
        return installed

    def attach_moe_layer(self, moe_layer: torch.nn.Module) -> list[tuple[str, DeferrableWeights]]:
        """`attach` for one MoE layer with no transformer layer around it (a benchmark, a test): its deferrable
        submodules get keys "L{moe_layer.layer_number}.{name}"."""
        installed = []
        if self.wgrad_queue is not None:
            installed = install.install_stores(install.moe_layer_modules(moe_layer), self.wgrad_queue)
        install.set_dispatchers(moe_layer, self)
        return installed

    # ------------------------------------------------------------------ backward: under each all-to-all

    def run_under(self, record: Collective, handle: CommHandle) -> torch.Tensor:
        """A backward all-to-all of MoE layer `record.layer` has started: release that layer's planned gradient
        reductions, then run the queue's closures for it and wait (or wait)."""
        if self.grad_reduce is not None:
            self.grad_reduce.release_layer(record.layer)
        handover.under_backward_comm()  # --overlap-moe-expert-parallel-comm: the paired forward's next stage
        if self.wgrad_queue is not None:
            return self.wgrad_queue.run_under(record, handle)
        return handle.wait()

    # ------------------------------------------------------------------ the Trainer's calls

    def start_iteration(self) -> None:
        """Before each training iteration, on every rank."""
        self.job_steps += 1
        if self.wgrad_queue is not None:
            self.wgrad_queue.start_iteration(self.job_steps)

    def end_iteration(self) -> None:
        """After each training iteration's backward passes, on every rank (collective after greedy's profile)."""
        if self.wgrad_queue is not None:
            self.wgrad_queue.end_iteration()

    def stats(self) -> dict:
        """This iteration's figures: {"wgrad": the queue's, "grad_reduce": the launcher's}, None for a feature off."""
        return {
            "wgrad": self.wgrad_queue.stats() if self.wgrad_queue else None,
            "grad_reduce": self.grad_reduce.stats() if self.grad_reduce else None,
        }

    def wgrad_report_due(self) -> bool:
        """--overlap-wgrad-report: this is the first iteration under greedy's schedule."""
        queue = self.wgrad_queue
        return queue is not None and queue.report and queue.first_planned_iteration()

    def started(self) -> None:
        """The first iteration completed (or none will run): `on_started`, once."""
        if self.on_started is not None:
            self.on_started()
            self.on_started = None
