"""megatron-core's TopKRouter beside our layer's router: the process groups it reads, from the parallel state
(needs the `megatron_world1` fixture)."""

from __future__ import annotations

import types

from megatron.core import parallel_state


def router_groups() -> types.SimpleNamespace:
    """The process groups megatron-core's TopKRouter reads (its `pg_collection`), from the parallel state."""
    return types.SimpleNamespace(
        tp=parallel_state.get_tensor_model_parallel_group(),
        cp=parallel_state.get_context_parallel_group(),
        tp_cp=parallel_state.get_tensor_and_context_parallel_group(),
        tp_dp_cp=parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True),
    )
