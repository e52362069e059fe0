"""Host memory on a CPU-only machine: keep freed blocks for reuse, as a GPU caching allocator does.

`keep_freed_host_memory()` makes glibc malloc serve every block from the heap (no mmap) and never trim it, so
the resident set stays at the high-water mark a training process reaches every step anyway, and a step's
activations stop faulting in fresh, zeroed pages. `MEGATRON_MOE_HOST_ALLOCATOR=system` keeps glibc's defaults;
other C libraries (musl) and platforms without `mallopt` are left alone.
Why, the measured effect and the heap's remaining growth: docs/internals/platform.md.
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
