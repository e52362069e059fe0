"""Host memory on a CPU-only machine: keep freed blocks for reuse, as a GPU caching allocator does.

glibc malloc serves large blocks (it starts at 128 KiB and adapts up to 32
MiB) with a fresh `mmap` and returns them with `munmap` on free; it also
gives freed memory at the top of the heap back to the kernel above a trim
threshold. A training step allocates the same big activations every
iteration, so with those defaults each step touches hundreds of MiB of new
pages: every 4 KiB page faults and is zeroed by the kernel. Measured on the
2-core CI machine, one MoE layer at GPT2-S shapes (8192 tokens, top-2):
342k page faults and 4.9 s per forward+backward with the defaults, 2.7 s
with blocks kept for reuse (see `tools/bench_moe_layer.py`).

`keep_freed_host_memory()` serves every block from the heap (no mmap) and
never trims it, so the resident set stays at the high-water mark, which is
what a training process reaches every step anyway. The heap still grows
now and then after warm-up: torch allocates with posix_memalign, whose
slack keeps a freed block from fitting a request of its own size, so a
buffer sometimes lands on fresh heap until the holes coalesce. Set
`MEGATRON_MOE_HOST_ALLOCATOR=system` to keep glibc's defaults; other C
libraries (musl) and platforms without `mallopt` are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

ENV = "MEGATRON_MOE_HOST_ALLOCATOR"
CHOICES = ("reuse", "system")

# glibc <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_NEVER = -1  # glibc stores the trim threshold as size_t: -1 is SIZE_MAX, never trim


def _glibc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # glibc only  # noqa: B018
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def keep_freed_host_memory() -> bool:
    """Serve all host blocks from the heap and keep freed ones; True when applied (once per process)."""
    mode = os.environ.get(ENV, "reuse")
    if mode not in CHOICES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(CHOICES)}")
    libc = _glibc() if mode == "reuse" else None
    if libc is None:
        return False
    # mallopt returns 1 on success.
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, _NEVER))
