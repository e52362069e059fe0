"""The seam where an expert node's backward hands over its weight-gradient GEMMs.

The backward of `GroupedMLP` and `GroupedLinear` computes the input gradient
(on the critical path) itself and wraps the weight-gradient GEMMs in a
`WeightGrad`: a closure that owns every tensor it reads (it never reads the
autograd ctx) and returns the gradients, written into the outputs it is
given (e.g. views of megatron-core's `main_grad`) or fresh where an output
is None. The node gives it to its `WeightGradStore`. `RUN_NOW` runs it at
once, so autograd gets the weight gradients as before; a store that queues
it (Lancet: run while an all-to-all is in flight) returns None, the node
then returns no weight gradient to autograd and the store owns it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

WeightGrad = Callable[..., tuple[torch.Tensor | None, ...]]
"""weight_grad(*outs) -> one gradient per weight (None where not needed); an out None: a fresh tensor."""


class WeightGradStore(Protocol):
    defers: bool
    """True when `put` may keep closures (a node then hands over one closure per backward, not one per run)."""

    def put(self, weight_grad: WeightGrad, outs: tuple) -> tuple | None:
        """Run `weight_grad(*outs)` now and return its gradients, or keep it to run later and return None."""
        ...


class RunNow:
    """The default store: the weight-gradient GEMMs run inside the backward that made them."""

    defers = False

    def put(self, weight_grad: WeightGrad, outs: tuple) -> tuple:
        return weight_grad(*outs)


RUN_NOW = RunNow()


class _AtPosition:
    """A store for one of a module's several weights: the closure's single gradient goes at `position` of
    `size` (the module's closures return one entry per deferred weight)."""

    defers = True

    def __init__(self, store: WeightGradStore, position: int, size: int):
        self.store, self.position, self.size = store, position, size

    def put(self, weight_grad: WeightGrad, outs: tuple) -> tuple | None:
        def placed(*outs):
            grads: list = [None] * self.size
            grads[self.position] = weight_grad(*outs[self.position : self.position + 1])[0]
            return tuple(grads)

        grads = self.store.put(placed, (None,) * self.size)
        return None if grads is None else (grads[self.position],)  # the node asked for its one weight's


def at_position(store: WeightGradStore, position: int, size: int) -> WeightGradStore:
    """`store` itself when it runs closures now; else a view of it for a module's weight number `position`."""
    return store if not store.defers else _AtPosition(store, position, size)


class DeferrableWeights:
    """Mixin of a module whose backward hands its weight-gradient GEMMs to `self.weight_grad_store`.

    Lancet (`megatron_moe.overlap`) installs a store that queues them and runs
    them under a backward all-to-all; the module's `deferred_params()` are then
    marked `skip_backward_post_hook` before megatron-core's DDP wraps the model,
    and DDP (`DistributedDataParallelConfig.delay_wgrad_compute`) hands this
    module, not autograd, each such parameter's hook (`main_grad` accumulation
    and bucket readiness) through `register_wgrad_accumulation_and_reduce_hooks`.
    The store sets `param.grad` and calls the parameter's hook when its dW ran.

    Contract for a subclass: every closure given to the store returns one entry
    per `deferred_params()` parameter, in that order (None for the ones it does
    not compute); its arithmetic is exactly what autograd would have run.
    Only leaf modules may mix this in: megatron-core registers a parameter's
    hook on every module whose `parameters()` holds it.
    """

    weight_grad_store: WeightGradStore = RUN_NOW
    store_key: str | None = None
    """The plan's name for this module's dW ("L{layer}.{name}"); set by the installer."""

    def deferred_params(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradient the store computes, in the order the closures return them."""
        raise NotImplementedError

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable) -> None:
        """megatron-core DDP's protocol: `hook` is the backward post-hook of the next marked parameter.

        DDP calls this once per marked parameter in `parameters()` order; the
        i-th call belongs to the i-th marked one of `deferred_params()`."""
        hooks = self.__dict__.setdefault("_wgrad_hooks", {})
        marked = [p for p in self.deferred_params() if getattr(p, "skip_backward_post_hook", False)]
        hooks[id(marked[len(hooks)])] = hook

    def wgrad_hook(self, param: torch.nn.Parameter) -> Callable | None:
        """DDP's hook for `param`, or None (no DDP, or the parameter is not deferred)."""
        return self.__dict__.get("_wgrad_hooks", {}).get(id(param))
