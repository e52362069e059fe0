"""GPU behaviour imitated: an emulated transfer for the one-GPU stream tests (`test_gpu_lancet.py`,
`test_gpu_pipeline.py`), and megatron-core's RNG tracker as on a GPU for CPU tests (`device_generator_apart`).

One GPU cannot run an EP group, so a collective is a stand-in with the same shape in time: its bytes go
device -> pinned host -> device on a side stream (copy engines, not SMs), as NCCL's kernels run on their own
stream, and `wait()` makes the current stream wait for the copy's end event, never the host.
"""

import contextlib

import torch

from megatron_moe.comm.core import CommHandle


class DeviceHandle(CommHandle):
    """A started transfer: `wait()` makes the current stream wait for its end event (never the host)."""

    def __init__(self, result, end: torch.cuda.Event, keepalive):
        super().__init__(result, keepalive=keepalive)
        self.end = end

    def wait(self):
        torch.cuda.current_stream().wait_event(self.end)
        return super().wait()


def emulated_transfer(t: torch.Tensor, copies: int) -> tuple[DeviceHandle, torch.cuda.Event, torch.cuda.Event]:
    """Start `copies` round trips of `t` through pinned host memory on a side stream, after the work the current
    stream has queued so far; (its handle, its start and end events, both timing)."""
    t = t.contiguous()
    side, ready = torch.cuda.Stream(), torch.cuda.Event()
    ready.record()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host, out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True), torch.empty_like(t)
    with torch.cuda.stream(side):
        side.wait_event(ready)
        start.record()
        for _ in range(copies):
            host.copy_(t, non_blocking=True)
            out.copy_(host, non_blocking=True)
        end.record()
    return DeviceHandle(out, end, keepalive=(t, host)), start, end


@contextlib.contextmanager
def device_generator_apart():
    """megatron-core's RNG tracker as on a GPU: its streams live in a generator of their own (CUDA's), apart from
    the host's default generator, which `fork()` then leaves alone.

    On CPU the platform layer points the tracker at the host generator (`cpu_compat`'s cpu_rng patch), so a
    fork also swaps what host-side draws read: the CPU run differs from a GPU run exactly there. Inside this
    block the tracker seeds, reads and writes a stand-in device generator instead; re-seed the tracker inside
    it (`model_parallel_cuda_manual_seed`), as its states are taken from whichever generator is current.
    """
    from megatron.core.tensor_parallel import random as mc_random

    device = torch.Generator()

    def get_state(device_index=None, clone=False, graph_safe=False):
        return device.get_state()

    def set_state(state, device_index=None, graph_safe=False):
        device.set_state(state)

    names = (
        (mc_random, "_get_cuda_rng_state", get_state),
        (mc_random, "_set_cuda_rng_state", set_state),
        (torch.cuda, "get_rng_state", get_state),
        (torch.cuda, "set_rng_state", set_state),
        (torch.cuda, "manual_seed", lambda seed: device.manual_seed(int(seed))),
    )
    before = [(owner, name, getattr(owner, name)) for owner, name, _ in names]
    for owner, name, fn in names:
        setattr(owner, name, fn)
    try:
        yield device
    finally:
        for owner, name, fn in before:
            setattr(owner, name, fn)
