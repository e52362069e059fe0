"""Waits of the host for the device: the one intended read (`to_host`), and a counter of all of them.

`to_host(*tensors)` brings integer tensors to the host in ONE device->host copy (the MoE layer's planning read,
once per forward); `table_to_host(table)` does the same for a table of figures (the step's MoE metrics).
`count_host_syncs()` counts every wait inside a block, so a test can pin the number: on CUDA the synchronizing
calls `torch.cuda.set_sync_debug_mode("warn")` reports; on CPU what WOULD wait on an accelerator (aten ops whose
result the host reads or whose output size depends on values, seen by a `TorchDispatchMode`, and host reads of
host tensors outside `backward()`, seen by a `TorchFunctionMode`). Both modes exist only inside the block.
Invariant: a wait inside a C++ kernel is only seen by the CUDA counter.
Which ops count, and why: docs/internals/platform.md.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_moe.platform.device import current_platform


def to_host(*tensors: torch.Tensor | None) -> list[list[int] | None]:
    """The values of integer tensors as flat Python lists, read in ONE device->host copy (None stays None)."""
    present = [t.reshape(-1).long() for t in tensors if t is not None]
    if not present:
        return [None] * len(tensors)
    values = (present[0] if len(present) == 1 else torch.cat(present)).tolist()  # the one wait for the device
    out, at = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
        else:
            out.append(values[at : at + t.numel()])
            at += t.numel()
    return out


def table_to_host(table: torch.Tensor) -> list[list[float]]:
    """A 2-D tensor's values as Python rows (float64 precision kept), read in ONE device->host copy: a step's
    figures computed on the device are read with this once, then only Python touches them."""
    return table.double().tolist()  # the one wait for the device


class HostSyncs:
    """The waits seen inside `count_host_syncs()`: `count`, and what each one was (`events`)."""

    def __init__(self):
        self.events: list[str] = []

    @property
    def count(self) -> int:
        return len(self.events)


@contextlib.contextmanager
def count_host_syncs(device: torch.device | None = None) -> Iterator[HostSyncs]:
    """Count the host's waits for `device` (default: the platform's) in this block; see the module docstring."""
    syncs = HostSyncs()
    device = current_platform().device if device is None else torch.device(device)
    if device.type != "cpu":
        with _cuda_sync_warnings(syncs):
            yield syncs
        return
    with _AtenWaits(syncs), _PythonReads(syncs):
        yield syncs


@contextlib.contextmanager
def _cuda_sync_warnings(syncs: HostSyncs):
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" in str(message):
                syncs.events.append(f"{message} ({filename}:{lineno})")
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


_VALUE_READS = ("_local_scalar_dense", "equal", "allclose")
_VALUE_SIZED = ("nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount")
_WAITING_OPS = frozenset((*_VALUE_READS, *_VALUE_SIZED))
"""aten ops whose result the host needs (item, bool, int, float, format, index) or whose output size depends
on values."""
_PYTHON_READS = frozenset({"tolist", "numpy", "__array__", "cpu"})
"""Reads that copy to the host without an aten op when the tensor is already there (on CPU)."""


def _has_mask(indices) -> bool:
    return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _aten_waits(func, args, kwargs) -> bool:
    name = func.overloadpacket.__name__
    if name in _WAITING_OPS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return _has_mask(args[1])
    if name == "repeat_interleave":  # tensor repeats: the output size is their sum, unless given
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    return False


def _reads_into_python(func, args, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    if name in _PYTHON_READS:
        return True
    if name == "to":
        targets = [*args[1:], kwargs.get("device")]
        return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)
    return False


class _AtenWaits(TorchDispatchMode):
    """aten ops that make the host wait: seen in forward and in backward (also autograd's own)."""

    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _aten_waits(func, args, kwargs):
            self.syncs.events.append(func.overloadpacket.__name__)
        return func(*args, **kwargs)


class _PythonReads(TorchFunctionMode):
    """`tolist`, `numpy`, `cpu`, `.to("cpu")`: no aten op on a CPU tensor, so seen at the Python API.

    Torch function modes are off inside `Tensor.backward`: a custom backward's `tolist` is not seen on CPU.
    """

    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_into_python(func, args, kwargs):
            self.syncs.events.append(func.__name__)
        return func(*args, **kwargs)
