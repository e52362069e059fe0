"""Communication hidden under computation (README.md here: the map of what plans, executes and measures).

Contract: `OverlapRuntime` (runtime.py) is the one object a run builds, attaches to its model once and pulls from
(Lancet's `WgradQueue`, the gradient-reduce launcher, the plans and fits); the planners (`cost_model`, `degrees`,
`grad_partition`, `op_partition`, `wgrad_schedule`) are pure code, no process group. `PROBES`: this package's
interventions in megatron-core, each probed (tests/unit/test_platform.py).
Loaded on first use (PEP 562): the NumPy/SciPy planners import without torch and megatron-core (tools/plan_*.py).
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_moe.overlap.runtime import OverlapPlans, OverlapRuntime
    from megatron_moe.overlap.wgrad_queue import WgradQueue

_LAZY = {
    "OverlapPlans": "megatron_moe.overlap.runtime",
    "OverlapRuntime": "megatron_moe.overlap.runtime",
    "WgradQueue": "megatron_moe.overlap.wgrad_queue",
}


def __getattr__(name: str):
    if name == "PROBES":  # the engine's interventions in megatron-core (a subclass, a class swap, a copy), probed
        parts = ("batch", "grad_reduce", "install", "linears")
        return tuple(p for part in parts for p in importlib.import_module(f"megatron_moe.overlap.{part}").PROBES)
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PROBES", "OverlapPlans", "OverlapRuntime", "WgradQueue"]
