"""Communication hidden under computation (README.md here: the map of what plans, executes and measures).

Lancet: weight-gradient GEMMs run under the backward all-to-alls.

`wgrad_schedule.py`: Lancet's Algorithm 1 (which dW under which all-to-all); `runtime.py`: the queue that runs it;
`install.py`: wiring it into a model; `linears.py`: megatron-core's Column/RowParallelLinear whose weight
gradient goes through a store.

FSMoE: `cost_model.py`, the fitted time model and Algorithm 1 (pipeline degrees per layer);
`profiler.py`, the micro-benchmarks that fit it on the running cluster; `degrees.py`, a run's flags -> each MoE
layer's degrees (tools/plan_schedule.py prints them).

Lancet's operator partition: `op_partition.py`, the planner (which layer ranges run in batch pieces, how many).
"""

from megatron_moe.overlap import grad_reduce, install, linears
from megatron_moe.overlap.install import install_on_moe_layer, install_wgrad_overlap
from megatron_moe.overlap.runtime import WgradQueue

PROBES = grad_reduce.PROBES + install.PROBES + linears.PROBES
"""The overlap engine's interventions in megatron-core (a subclass, a class swap, a copy), each with its probe."""

__all__ = ["PROBES", "WgradQueue", "install_on_moe_layer", "install_wgrad_overlap"]
