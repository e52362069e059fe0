"""An emulated transfer for the one-GPU stream tests (`test_gpu_lancet.py`, `test_gpu_pipeline.py`).

One GPU cannot run an EP group, so a collective is a stand-in with the same shape in time: its bytes go
device -> pinned host -> device on a side stream (copy engines, not SMs), as NCCL's kernels run on their own
stream, and `wait()` makes the current stream wait for the copy's end event, never the host.
"""

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
