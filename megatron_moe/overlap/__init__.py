"""Communication hidden under computation (README.md here: the map of what plans, executes and measures).

Lancet: weight-gradient GEMMs run under the backward all-to-alls.

`wgrad_schedule.py`: Lancet's Algorithm 1 (which dW under which all-to-all); `runtime.py`: the queue that runs it;
`install.py`: wiring it into a model; `linears.py`: megatron-core's Column/RowParallelLinear whose weight
gradient goes through a store.

FSMoE: `cost_model.py`, the fitted time model and Algorithm 1 (pipeline degrees per layer);
`profiler.py`, the micro-benchmarks that fit it on the running cluster; `degrees.py`, a run's flags -> each MoE
layer's degrees (tools/plan_schedule.py prints them).

Lancet's operator partition: `op_partition.py`, the planner (which layer ranges run in batch pieces, how many).

Loaded on first use (PEP 562): the planners (`cost_model.py`, `degrees.py`, `grad_partition.py`) are NumPy and
SciPy only, so tools/plan_schedule.py and tools/plan_cluster.py build their command lines without the engine's
torch and megatron-core imports; `from megatron_moe.overlap import X` works as before.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_moe.overlap.install import install_on_moe_layer, install_wgrad_overlap
    from megatron_moe.overlap.runtime import WgradQueue

_LAZY = {
    "install_on_moe_layer": "megatron_moe.overlap.install",
    "install_wgrad_overlap": "megatron_moe.overlap.install",
    "WgradQueue": "megatron_moe.overlap.runtime",
}


def __getattr__(name: str):
    if name == "PROBES":  # the engine's interventions in megatron-core (a subclass, a class swap, a copy), probed
        parts = ("grad_reduce", "install", "linears")
        return tuple(p for part in parts for p in importlib.import_module(f"megatron_moe.overlap.{part}").PROBES)
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PROBES", "WgradQueue", "install_on_moe_layer", "install_wgrad_overlap"]
