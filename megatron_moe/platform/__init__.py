"""The platform layer: the only place in megatron_moe that knows about devices.

`init_platform()` picks the device and the torch.distributed backend (cuda+nccl
when CUDA is available, else cpu+gloo) and, on a machine without CUDA, applies
the CPU compatibility patches that let megatron-core 0.16.1 run there
(`cpu_compat.py`). Everything else in megatron_moe asks this module for the
device, the RNG, memory figures, optional kernels and host syncs (`host_sync.py`)
instead of naming one.
"""

from megatron_moe.platform.device import (
    PeakRate,
    Platform,
    bind_thread,
    current_platform,
    device_name,
    from_host,
    init_platform,
    kernels_in_use,
    measure_gemm_rate,
    memory_in_use_bytes,
    peak_flops_per_s,
    peak_memory_bytes,
    synchronize,
)
from megatron_moe.platform.host_sync import HostSyncs, count_host_syncs, table_to_host, to_host

__all__ = [
    "HostSyncs",
    "PeakRate",
    "Platform",
    "bind_thread",
    "count_host_syncs",
    "current_platform",
    "device_name",
    "from_host",
    "init_platform",
    "kernels_in_use",
    "measure_gemm_rate",
    "memory_in_use_bytes",
    "peak_flops_per_s",
    "peak_memory_bytes",
    "synchronize",
    "table_to_host",
    "to_host",
]
