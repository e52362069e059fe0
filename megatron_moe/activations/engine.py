"""Carrying out an ActivationPolicy with saved-tensor hooks, and counting what is kept.

One `saved_tensors_hooks` pair is installed around each transformer layer's
forward (`LayerScope`). Module regions inside it (`region(name)`) tell the
pack hook which module is saving; outputs of `recompute` modules are
registered, so when *anyone* saves such an output (or a view of it) for
backward the hook stores a recipe instead: the module's function, its inputs
and its RNG state at the time. Backward replays the recipe once (cached for
all consumers), restoring the RNG so dropout masks match.

A fused autograd node that spans several modules (the experts' fc1 -> act ->
fc2, `GroupedMLP`) saves its tensors itself: `FusedKeeping.keep` says what
it keeps of each at forward, `FusedKeeping.fetch` gives it back in backward
(rows of a run, dequantized) or None, and the node recomputes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from megatron_moe.activations.quantize import Packed, dequantize, dequantize_rows, quantize, worth_quantizing
from megatron_moe.config.activation_policy import ActivationPolicy
from megatron_moe.platform.rng import get_rng_states, set_rng_states


class SavedBytes:
    """Exact bytes of what autograd keeps for backward (each storage counted once)."""

    def __init__(self):
        self.bytes = 0
        self._seen: set[int] = set()

    def add_tensor(self, t: torch.Tensor) -> None:
        if isinstance(t, torch.nn.Parameter):
            return  # weights are not activations
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()

    def add(self, stored: Any) -> None:
        if isinstance(stored, Use):
            stored = stored.shared.packed
        if isinstance(stored, Packed):
            if id(stored) not in self._seen:  # one packed copy may serve several savers
                self._seen.add(id(stored))
                self.bytes += stored.nbytes
        elif isinstance(stored, Recipe):
            for t in stored.entry.tensor_inputs():
                self.add(t)
        elif torch.is_tensor(stored):
            self.add_tensor(stored)

    @contextlib.contextmanager
    def counting(self):
        """Count everything saved in this context that no inner policy scope handles."""

        def pack(t):
            self.add(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield self


class Shared:
    """One packed copy that several savers keep: dequantized once, kept while a saver has yet to read it.

    `rows`: (width, row stride) when the copy holds rows of storage in memory
    order (a saver's view lies in it with its own strides, rescaled from the
    row stride to the packed width); None when it holds one view's elements,
    copied in that view's logical order.
    """

    def __init__(self, packed: Packed, rows: tuple[int, int] | None):
        self.packed, self.rows, self.users = packed, rows, 0
        self._value: torch.Tensor | None = None

    @property
    def in_storage_order(self) -> bool:
        return self.rows is not None

    def use(self, t: torch.Tensor) -> Use:
        """A saver's use of this copy for its view `t`."""
        self.users += 1
        if self.rows is None:
            return Use(self, tuple(t.shape), torch.empty(t.shape, device="meta").stride())
        width, row_stride = self.rows
        stride = tuple(s if s < row_stride else s // row_stride * width for s in t.stride())
        return Use(self, tuple(t.shape), stride)

    def take(self) -> torch.Tensor:
        value = dequantize(self.packed) if self._value is None else self._value
        self.users -= 1
        self._value = value if self.users > 0 else None
        return value


@dataclasses.dataclass
class Use:
    """What one saver keeps of a shared packed copy: the copy, and where its own view lies in it."""

    shared: Shared
    size: tuple
    stride: tuple

    def value(self) -> torch.Tensor:
        block = self.shared.take()
        return block.as_strided(self.size, self.stride, block.storage_offset())


@dataclasses.dataclass
class _Entry:
    """How to recompute one module call's output."""

    fn: Callable
    args: tuple
    kwargs: dict
    rng: Any
    output: Any = None  # the live output during forward, the recomputed one in backward

    def tensor_inputs(self):
        return [a for a in (*self.args, *self.kwargs.values()) if torch.is_tensor(a) or isinstance(a, Use)]

    def recompute(self):
        if self.output is None:
            saved = get_rng_states()
            set_rng_states(self.rng)
            args = tuple(a.value() if isinstance(a, Use) else a for a in self.args)
            try:
                with torch.no_grad():
                    self.output = self.fn(*args, **self.kwargs)
            finally:
                set_rng_states(saved)
        return self.output


@dataclasses.dataclass
class Recipe:
    entry: _Entry
    path: tuple  # where the saved tensor sits in the output structure
    size: tuple
    stride: tuple
    offset_delta: int  # its storage offset relative to that output's


def _tensors_with_paths(obj, path=()):
    if torch.is_tensor(obj):
        yield path, obj
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from _tensors_with_paths(item, (*path, i))


def _at(obj, path):
    for i in path:
        obj = obj[i]
    return obj


@dataclasses.dataclass(frozen=True)
class FusedKeeping:
    """What one fused fc1 -> act -> fc2 node keeps for backward, under a policy.

    Per tensor, `save`, `quantize` or `recompute`: x (fc1's input), h (fc1's
    output = act's input; recomputed as fc1(x)), a (act's output = fc2's
    input; recomputed as act(h)). The same numbers as the three modules run as
    separate regions of the policy (`LayerScope.fused_keeping`).
    """

    x: str = "save"
    h: str = "save"
    a: str = "save"
    scope: LayerScope | None = None

    def keep(self, name: str, t: torch.Tensor, numel: int | None = None):
        """Forward: tensor `name` (x, h or a; part of a tensor of `numel` elements) as it is to be kept: `t`
        itself (the node saves it for backward), a packed copy (counted), or None (to be recomputed)."""
        how = getattr(self, name)
        if how == "recompute":
            return None
        return self.scope.quantized(t, numel) if how == "quantize" else t

    @staticmethod
    def fetch(kept, start: int, end: int) -> torch.Tensor | None:
        """Backward: rows [start, end) of what `keep` returned, dequantized; None: recompute them."""
        return None if kept is None else rows_of(kept, start, end)


SAVE_ALL = FusedKeeping()


def rows_of(stored, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of a kept tensor or packed copy."""
    return dequantize_rows(stored, start, end) if isinstance(stored, Packed) else stored[start:end]


def _row_block(t: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
    """`t`'s storage as [rows, width] rows along its stride-1 dim with one row stride, when `t` is a
    permutation of such rows (a dense block, or rows with equal gaps between them: attention's v as a
    view of the fused QKV output); else None. Returns (rows view, width, row stride)."""
    dims = sorted((d for d in range(t.dim()) if t.size(d) != 1), key=t.stride, reverse=True)
    if not dims or t.stride(dims[-1]) != 1:
        return None
    width = t.size(dims[-1])
    row_stride = t.stride(dims[-2]) if len(dims) > 1 else width
    if row_stride < width:
        return None
    expected = row_stride
    for d in reversed(dims[:-1]):
        if t.stride(d) != expected:
            return None
        expected *= t.size(d)
    return t.as_strided((t.numel() // width, width), (row_stride, 1)), width, row_stride


class LayerScope:
    """The hooks of one policy, active for the forward of one layer at a time."""

    def __init__(self, policy: ActivationPolicy, counter: SavedBytes | None = None):
        self.policy = policy
        self.counter = counter
        self._regions: list[str] = []
        self._outputs: dict[int, tuple[_Entry, tuple, torch.Tensor]] = {}
        self._packed: dict[tuple, tuple[torch.Tensor, Shared]] = {}

    @contextlib.contextmanager
    def active(self):
        self._outputs.clear()
        self._packed.clear()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            # Drop the live outputs: from here on only recipes reference entries.
            for entry, _, _ in self._outputs.values():
                entry.output = None
            self._outputs.clear()
            self._packed.clear()

    @contextlib.contextmanager
    def region(self, name: str):
        self._regions.append(name)
        try:
            yield
        finally:
            self._regions.pop()

    def call(self, name: str, fn: Callable, *args, **kwargs):
        """Run one module call under its policy."""
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        mode = self.policy.mode(name)
        recompute = mode.startswith("recompute")
        rng = get_rng_states() if recompute else None
        with self.region(name):
            output = fn(*args, **kwargs)
        if recompute:
            keep = self._quantized_use if mode == "recompute+quantize" else torch.Tensor.detach
            stored = tuple(keep(a) if torch.is_tensor(a) else a for a in args)
            entry = _Entry(fn, stored, kwargs, rng, output)
            for path, t in _tensors_with_paths(output):
                if t.is_floating_point():
                    self._outputs[t.untyped_storage().data_ptr()] = (entry, path, t)
        return output

    def fused_keeping(self, fc1: str, act: str, fc2: str) -> FusedKeeping | None:
        """How a fused node spanning modules fc1 -> act -> fc2 keeps x, h, a under this policy.

        None when fc2 is to be recomputed: its output is then registered per
        region, so the modules must run apart.
        """
        m1, ma, m2 = (self.policy.mode(name) for name in (fc1, act, fc2))
        if m2.startswith("recompute"):
            return None
        x = "quantize" if m1.endswith("quantize") else "save"
        h = "recompute" if m1.startswith("recompute") else "quantize" if ma.endswith("quantize") else "save"
        a = "recompute" if ma.startswith("recompute") else "quantize" if m2.endswith("quantize") else "save"
        return FusedKeeping(x, h, a, self)

    def quantized(self, t: torch.Tensor, numel: int | None = None):
        """`t` (2-D, contiguous; part of a tensor of `numel` elements) packed for a node that keeps it itself
        (counted), or `t` if not worth it. The packed copy's rows are `t`'s rows (`rows_of`)."""
        shared = self._shared(t, numel) if t.is_contiguous() else None
        if shared is None:
            return t
        if self.counter is not None:
            self.counter.add(shared.packed)
        return shared.packed

    def _pack(self, t: torch.Tensor):
        stored: Any = t
        registered = self._outputs.get(t.untyped_storage().data_ptr()) if t.is_floating_point() else None
        if registered is not None:
            entry, path, output = registered
            delta = t.storage_offset() - output.storage_offset()
            stored = Recipe(entry, path, tuple(t.shape), tuple(t.stride()), delta)
        elif self._regions and self.policy.mode(self._regions[-1]).endswith("quantize"):
            stored = self._quantized_use(t)
        if self.counter is not None:
            self.counter.add(stored)
        return stored

    def _quantized_use(self, t: torch.Tensor):
        """What a saver keeps of `t`: a use of its shared packed copy, or `t` if not worth packing."""
        shared = self._shared(t)
        return t if shared is None else shared.use(t)

    def _shared(self, t: torch.Tensor, numel: int | None = None) -> Shared | None:
        """The packed copy of `t` in this scope (made on first request), None if not worth it.

        A view that is a permutation of rows of one row stride in its storage
        (attention's q, k as [b*np, s, hn] views of [s, b, np, hn]; v, a view of
        the fused QKV output with a gap after every row) is packed in storage
        order, rows along its stride-1 dim, without a copy; views of the same
        rows share that copy (attention probs as [b, np, s, s] and as
        [b*np, s, s]). Other views are packed as a copy.
        """
        fmt = self.policy.quant_format
        if not worth_quantizing(t, fmt, numel) or isinstance(t, torch.nn.Parameter):
            return None
        where = (t.untyped_storage().data_ptr(), t.storage_offset())
        block = _row_block(t)
        key = (*where, t.numel(), *block[1:]) if block is not None else (*where, tuple(t.shape), tuple(t.stride()))
        cached = self._packed.get(key)
        if cached is None:
            packed = quantize(t if block is None else block[0], fmt, self.policy.quant_block)
            rows = None if block is None else block[1:]
            cached = self._packed[key] = (t, Shared(packed, rows))
        return cached[1]

    @staticmethod
    def _unpack(stored):
        if isinstance(stored, Use):
            return stored.value()
        if isinstance(stored, Recipe):
            full = _at(stored.entry.recompute(), stored.path)
            return full.as_strided(stored.size, stored.stride, full.storage_offset() + stored.offset_delta)
        return stored
