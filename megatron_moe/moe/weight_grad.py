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
    def put(self, weight_grad: WeightGrad, outs: tuple) -> tuple | None:
        """Run `weight_grad(*outs)` now and return its gradients, or keep it to run later and return None."""
        ...


class RunNow:
    """The default store: the weight-gradient GEMMs run inside the backward that made them."""

    def put(self, weight_grad: WeightGrad, outs: tuple) -> tuple:
        return weight_grad(*outs)


RUN_NOW = RunNow()
