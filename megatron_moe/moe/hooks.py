"""Hooks: change what flows between the MoE stages without touching the layer.

Six points, in this order in every forward: before_moe_start(tokens_TH) -> route -> order ->
before_dispatch(rows_RH) -> dispatch -> after_dispatch(rows_RH) -> experts -> before_combine(rows_RH) ->
combine -> after_combine(rows_RH) -> unorder -> before_moe_end(output_TH).

Each returns the tensor the next stage gets (the argument itself to leave it alone). A hook may change values,
dtype and row width, not the number of rows between `before_dispatch` and `after_dispatch` or between
`before_combine` and `after_combine`. Hooks run inside autograd. Register with `MoELayer.register_moe_hook`.
"""

from __future__ import annotations

import dataclasses
import time

import torch

HOOK_POINTS = (
    "before_moe_start",
    "before_dispatch",
    "after_dispatch",
    "before_combine",
    "after_combine",
    "before_moe_end",
)


@dataclasses.dataclass
class HookContext:
    """What a hook may want to know about the call it is in."""

    layer_number: int | None
    counts: list[int] | None = None
    """Rows per expert of the tensor at hand (global experts before dispatch, local after)."""


class MoEHook:
    """Base class: every point passes its tensor through; override the ones you need."""

    def before_moe_start(self, tokens_TH: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        return tokens_TH

    def before_dispatch(self, rows_RH: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        return rows_RH

    def after_dispatch(self, rows_RH: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        return rows_RH

    def before_combine(self, rows_RH: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        return rows_RH

    def after_combine(self, rows_RH: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        return rows_RH

    def before_moe_end(self, output_TH: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        return output_TH


class HookHandle:
    """Returned by registration; `remove()` unregisters the hook."""

    def __init__(self, hooks: list, hook: MoEHook):
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


class Bf16OnTheWire(MoEHook):
    """Send bf16 through both all-to-alls (half the bytes), compute in the original dtype.

    Compresses in `before_dispatch`/`before_combine` and restores the original
    dtype in `after_dispatch`/`after_combine`.
    """

    def __init__(self):
        self._dtype = torch.float32

    def before_dispatch(self, rows, ctx):
        self._dtype = rows.dtype
        return rows.to(torch.bfloat16)

    def after_dispatch(self, rows, ctx):
        return rows.to(self._dtype)

    def before_combine(self, rows, ctx):
        return rows.to(torch.bfloat16)

    def after_combine(self, rows, ctx):
        return rows.to(self._dtype)


class RegionClock(MoEHook):
    """Reads the host clock where dispatch -> experts -> combine starts and ends, forward and backward (tensor
    hooks on the rows at its two edges): the part of the layer FSMoE's cost model predicts and the pipeline
    degrees change (tools/bench_pipeline.py). Host times: on a GPU, synchronize before reading them."""

    def __init__(self):
        self.marks: dict[str, float] = {}

    def _mark(self, name: str):
        def hook(grad):
            self.marks[name] = time.perf_counter()
            return grad

        return hook

    def region_ms(self) -> tuple[float, float]:
        m = self.marks
        return 1000.0 * (m["forward_end"] - m["forward_start"]), 1000.0 * (m["backward_end"] - m["backward_start"])

    def before_dispatch(self, rows_RH, ctx):
        self.marks["forward_start"] = time.perf_counter()
        rows_RH = rows_RH.view_as(rows_RH)
        rows_RH.register_hook(self._mark("backward_end"))  # its gradient is complete: the dispatch's reverse is done
        return rows_RH

    def after_combine(self, rows_RH, ctx):
        self.marks["forward_end"] = time.perf_counter()
        rows_RH = rows_RH.view_as(rows_RH)
        rows_RH.register_hook(self._mark("backward_start"))
        return rows_RH
