"""torch.optim without its first-call import of dynamo, while nothing in the process has imported it.

torch.optim guards its methods against tracing: `Optimizer.add_param_group`, `zero_grad`, `state_dict` and
`load_state_dict` are `torch._disable_dynamo` wrappers, which import torch._dynamo on their first call, and Adam's,
AdamW's and SGD's `step` run under `_use_grad_for_differentiable`, which imports it on every call to place two
`graph_break()`s. Outside torch.compile both are no-ops, yet that import is 1.3 s of CPU in every training process
(megatron-core builds torch's AdamW on hosts without apex or transformer-engine; the test suite starts hundreds of
such processes). `install` makes them run eager while `torch._dynamo` is not in `sys.modules`, and exactly as torch
does once anything has imported it (something may compile then): the same grad mode, the same arguments, the same
function.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch.optim import optimizer as _optimizer

GUARDED_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
"""torch.optim.Optimizer's methods wrapped in torch._disable_dynamo."""
STEPPED_CLASSES = (torch.optim.Adam, torch.optim.SGD)
"""The optimizers megatron-core builds from torch (its `USING_PYTORCH_OPTIMIZER` path and the CPU offload), by the
class that defines their `step` (AdamW inherits Adam's)."""

_DISABLE_CODE = torch._disable_dynamo(lambda: None).__code__
_USE_GRAD_CODE = _optimizer._use_grad_for_differentiable(lambda self: None).__code__


def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


def _guarded(method) -> bool:
    return getattr(method, "__code__", None) is _DISABLE_CODE and hasattr(method, "__wrapped__")


def _stepped(step) -> bool:
    return getattr(step, "__code__", None) is _USE_GRAD_CODE and hasattr(step, "__wrapped__")


def still_needed() -> bool:
    """torch still wraps these methods so (the upgrade alarm)."""
    methods = [getattr(torch.optim.Optimizer, name) for name in GUARDED_METHODS]
    return all(map(_guarded, methods)) and all(_torch_step(cls.__dict__.get("step")) for cls in STEPPED_CLASSES)


def _torch_step(step):
    """torch's `_use_grad` wrapper of `step` (ours replaced it, or torch hooked it on a first instance), or None."""
    while step is not None and not _stepped(step):
        step = getattr(step, "torch_step", None) or getattr(step, "__wrapped__", None)
    return step


def _eager_until_dynamo(fn):
    """What torch._disable_dynamo's wrapper calls (its `fn.__dynamo_disable` cache): `fn` itself until dynamo is
    imported, then torch's own `torch._dynamo.disable(fn)`, cached as torch caches it."""

    def call(*args, **kwargs):
        if not _dynamo_loaded():
            return fn(*args, **kwargs)
        import torch._dynamo

        disabled = torch._dynamo.disable(fn, recursive=True, wrapping=False)
        fn.__dynamo_disable = disabled
        return disabled(*args, **kwargs)

    return call


def _eager_step(use_grad_step):
    """An optimizer's `step` as `_use_grad_for_differentiable` runs it (grad mode set to `differentiable`), without
    the graph breaks and their import until dynamo is loaded; then torch's own wrapper."""
    step = use_grad_step.__wrapped__

    @functools.wraps(step)
    def eager(self, *args, **kwargs):
        if _dynamo_loaded():
            return use_grad_step(self, *args, **kwargs)
        before = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return step(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(before)

    eager.torch_step = use_grad_step
    return eager


def install() -> None:
    """Apply once, before any of `STEPPED_CLASSES` is instantiated (torch hooks a class's `step` on its first
    instance: a class hooked already, or wrapped otherwise, is left as it is)."""
    if _dynamo_loaded():
        return
    for name in GUARDED_METHODS:
        method = getattr(torch.optim.Optimizer, name)
        if _guarded(method):
            method.__wrapped__.__dynamo_disable = _eager_until_dynamo(method.__wrapped__)
    for cls in STEPPED_CLASSES:
        step = cls.__dict__.get("step")
        if _stepped(step):
            cls.step = _eager_step(step)
