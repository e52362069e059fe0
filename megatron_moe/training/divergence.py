"""Divergence and NaN: a loss-spike warning, and a stop at the first non-finite loss or gradient.

The gradient check replaces megatron-core DDP's `check_for_nan_in_grad` (whose error says "iteration -1"):
it runs on each rank's local gradients before they are reduced, so the rank it names is the one where the
non-finite value appeared, and it names the real iteration and the first parameter (model order) hit.
fp16 runs skip it: their dynamic loss scale meets inf/NaN gradients on purpose and skips the step.

With a NaN loss every gradient is NaN, and the first parameter in model order is the embedding's: the
parameter alone rarely says where things went wrong. `ForwardFiniteFlags` records, on the device and without
a host sync, which module's forward output first held a NaN/inf; the stop message names it.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from collections.abc import Callable

import torch

from megatron_moe import comm
from megatron_moe.platform import to_host


class NonFiniteError(RuntimeError):
    """A NaN/inf loss or gradient: the run cannot continue."""


class LossSpikeDetector:
    """Warns on the first step whose loss jumps (factor 0: off):

    - above `factor` x the median of the previous `window` finite losses, once `min(window, 3)` are known (the
      median, not the mean: an earlier spike in the window does not raise the bar for the next one);
    - at iterations 1-3, above 2 x `initial`, the loss of an untrained model (ln of the padded vocabulary: a
      uniform prediction), before the window knows enough: a run that diverges at once (lr 1e3) is named at
      its first step, not when its loss becomes NaN.

    A flagged loss still enters the window.
    """

    EARLY_ITERATIONS = 3
    INITIAL_FACTOR = 2.0

    def __init__(self, *, factor: float, window: int, initial: float | None = None):
        self.factor = factor
        self.window = window
        self.initial = initial
        self._recent: deque[float] = deque(maxlen=window)

    def observe(self, iteration: int, loss: float) -> str | None:
        """The warning text for this step's `loss`, or None."""
        warning = None
        if self.factor > 0 and math.isfinite(loss):
            warning = self._against_window(iteration, loss) or self._against_initial(iteration, loss)
        if math.isfinite(loss):
            self._recent.append(loss)
        return warning

    def _against_window(self, iteration: int, loss: float) -> str | None:
        if len(self._recent) < min(self.window, 3):
            return None
        median = statistics.median(self._recent)
        if loss <= self.factor * median:
            return None
        return (
            f"loss spike at iteration {iteration}: lm loss {loss:.4E} is {loss / median:.1f}x the median "
            f"{median:.4E} of the last {len(self._recent)} steps (--loss-spike-factor={self.factor:g})"
        )

    def _against_initial(self, iteration: int, loss: float) -> str | None:
        if self.initial is None or iteration > self.EARLY_ITERATIONS or loss <= self.INITIAL_FACTOR * self.initial:
            return None
        return (
            f"loss spike at iteration {iteration}: lm loss {loss:.4E} is {loss / self.initial:.1f}x "
            f"ln(padded vocab) = {self.initial:.4f}, an untrained model's loss (over {self.INITIAL_FACTOR:g}x in "
            f"the first {self.EARLY_ITERATIONS} iterations; a lower --lr usually helps)"
        )


def first_nonfinite_grad(chunks) -> str | None:
    """The name of the first parameter (model order) whose gradient holds a NaN/inf and how many do, or None.

    One device->host read for the whole model (over the DDP grad buffers); the per-parameter walk runs
    only when something is non-finite.
    """
    flags = [
        torch.isfinite(buffer.grad_data).all()
        for chunk in chunks
        for buffer in chunk.buffers + chunk.expert_parallel_buffers
    ]
    with comm.host_read("finite grads"):
        if not flags or all(to_host(torch.stack(flags))[0]):
            return None
    # Under the interleaved pipeline a name's layer index is its chunk's own: the chunk is named too.
    named = [
        (name if len(chunks) == 1 else f"model chunk {i}: {name}", getattr(p, "main_grad", None))
        for i, chunk in enumerate(chunks)
        for name, p in chunk.module.named_parameters()
    ]
    with comm.host_read("finite grads, per parameter"):
        bad = [name for name, grad in named if grad is not None and not torch.isfinite(grad).all()]
    if not bad:
        return "(a gradient buffer outside the named parameters)"
    return f"{bad[0]} ({len(bad)} of {len(named)} parameters have non-finite gradients)"


# The modules whose forward outputs are watched, in the order data flows through them.
_WATCHED = re.compile(r"(^|\.)(embedding|decoder\.layers\.\d+|decoder\.final_layernorm|output_layer)$")


class ForwardFiniteFlags:
    """One device flag per watched module (embedding, each transformer layer, final norm, output layer) of
    this rank's model chunks, set when that module's forward output holds a NaN/inf since `reset()`.

    The hooks only accumulate on the device (no host sync in the step); `first()` reads the flags once,
    when a check has already failed.
    """

    def __init__(self, chunks):
        self._names: list[str] = []
        modules = []
        for chunk in chunks:
            for name, module in chunk.named_modules():
                if _WATCHED.search(name):
                    number = getattr(module, "layer_number", None)  # megatron-core's global 1-based number
                    short = name[name.index("decoder.") :] if "decoder." in name else name.rsplit(".", 1)[-1]
                    self._names.append(f"layer {number} ({short})" if number is not None else short)
                    modules.append(module)
        device = next(chunks[0].parameters()).device if chunks else None
        self._bad = torch.zeros(len(modules), dtype=torch.bool, device=device)
        self._handles = [module.register_forward_hook(self._hook(i)) for i, module in enumerate(modules)]

    def _hook(self, index: int):
        def record(module, inputs, output):
            tensor = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_tensor(tensor) and tensor.is_floating_point():
                self._bad[index] |= ~torch.isfinite(tensor.detach()).all()

        return record

    def reset(self) -> None:
        self._bad.zero_()

    def any(self) -> torch.Tensor:
        """Whether a watched output was non-finite since `reset()`: a device flag, no host read."""
        return self._bad.any()

    def first(self) -> str | None:
        """The first watched module (data-flow order) whose output was non-finite, or None. A host read."""
        if not self._names:
            return None
        with comm.host_read("forward finite flags"):
            bad = to_host(self._bad)[0]
        return next((name for name, flag in zip(self._names, bad, strict=True) if flag), None)

    def describe(self) -> str:
        """The clause the stop message carries: where the non-finite values first appeared in the forward."""
        if not self._names:
            return ""
        where = self.first()
        return f"; first non-finite forward output in {where}" if where else "; every forward output was finite"

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def reductions_in_flight(chunks) -> bool:
    """Whether a DDP bucket group of the model chunks has started its gradient reduction (not yet finished)."""
    return any(
        group.grad_reduce_handle is not None
        for chunk in chunks
        for group in getattr(chunk, "bucket_groups", []) + getattr(chunk, "expert_parallel_bucket_groups", [])
    )


def _no_origin() -> str:
    return ""


# A rank's slot in the agreed flag table (`comm.agree_nonfinite`), the highest that applies.
_LOCAL = 2  # non-finite in this rank's own values: its forward outputs, or its gradients before the reduction
_REDUCED = 1  # non-finite only after a data-parallel reduction overlapped with backward (it may come from a peer)


def _finite_forward() -> bool:
    return False


def check_grads_then(
    finalize: Callable,
    *,
    iteration: Callable[[], int],
    rank: int,
    world_size: int = 1,
    origin: Callable[[], str] = _no_origin,
    forward_nonfinite: Callable[[], torch.Tensor | bool] = _finite_forward,
) -> Callable:
    """`finalize` (megatron-core's finalize_model_grads) with the gradient check, then one small agreement over
    the world (`comm.agree_nonfinite`: every rank issues it at every step's finalize, the same on every rank),
    so that every rank stops at the same point with the same line, naming the ranks whose own values went
    non-finite first. `forward_nonfinite()`: whether this rank's forward outputs held a NaN/inf (a device flag,
    `ForwardFiniteFlags.any`, read with the agreement); `origin()`, asked only of such a rank, is appended.

    Each rank checks its own gradients before they are reduced. Where a bucket's data-parallel reduction has
    already started in backward (--overlap-grad-reduce, the adaptive --grad-reduce-schedule), its buffer is no
    longer this rank's alone, and a collective is writing it: the gradient check then follows the reduction, and
    the culprit is known from the forward outputs (a NaN born in backward is named on every rank it reached)."""

    def agree(model, grad_code: int, name: str | None) -> None:
        device = model[0].buffers[0].grad_data.device if model and model[0].buffers else None
        flags = torch.zeros(world_size, dtype=torch.int32, device=device)
        forward = torch.as_tensor(forward_nonfinite(), device=device).to(torch.int32) * _LOCAL
        flags[rank] = forward.clamp(min=grad_code)
        comm.agree_nonfinite(flags)
        with comm.host_read("agreed non-finite flags"):
            agreed = to_host(flags)[0]
        if any(agreed):
            raise NonFiniteError(_agreed_line(agreed, iteration(), rank, name, origin))

    def checked(model, *args, **kwargs):
        if not reductions_in_flight(model):
            name = first_nonfinite_grad(model)
            agree(model, 0 if name is None else _LOCAL, name)
            return finalize(model, *args, **kwargs)
        result = finalize(model, *args, **kwargs)
        name = first_nonfinite_grad(model)
        agree(model, 0 if name is None else _REDUCED, name)
        return result

    return checked


def _agreed_line(agreed: list[int], iteration: int, rank: int, name: str | None, origin: Callable[[], str]) -> str:
    """The same words on every rank (the culprit ranks), then what this rank knows of its own part."""
    culprits = [r for r, code in enumerate(agreed) if code == _LOCAL]
    if culprits:
        line = (
            f"non-finite values at iteration {iteration} first {_on(culprits)}: in their own forward outputs or "
            "gradients, before the data-parallel reduction"
        )
    else:
        line = (
            f"non-finite gradient at iteration {iteration} {_on([r for r, code in enumerate(agreed) if code])} "
            "(after the data-parallel reduction overlapped with backward: every forward output was finite)"
        )
    here = f"; here (rank {rank}): first in parameter {name}" if name else ""
    if agreed[rank] == _LOCAL:
        here += origin()
    return f"{line}{here} (a lower --lr usually helps)"


def _on(ranks: list[int]) -> str:
    return f"on rank {ranks[0]}" if len(ranks) == 1 else f"on ranks {ranks}"


def check_loss(loss: float | None, *, iteration: int, rank: int, origin: Callable[[], str] = _no_origin) -> None:
    """Stop on a NaN/inf step loss (None: not on the last pipeline stage); `origin()`, asked only then, is
    appended to the message."""
    if loss is not None and not math.isfinite(loss):
        raise NonFiniteError(f"non-finite lm loss ({loss}) at iteration {iteration} on rank {rank}{origin()}")
