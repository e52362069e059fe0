"""Lossy storage formats for activations kept for backward.

A format turns a floating-point tensor into a compact `Packed` and back:
int8 with one scale per row (last dim) or per block of `block` elements, or
fp8 e4m3 with one scale per row. Scales are fp32; the round trip returns the
original dtype and shape. Tensors that are not floating point, or too small
to be worth it, are never quantized (see `worth_quantizing`).
"""

from __future__ import annotations

import dataclasses

import torch

FORMATS = ("int8_row", "int8_block", "fp8_row")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_NUMEL = 4096  # below this the scales and bookkeeping cost more than they save


@dataclasses.dataclass(frozen=True)
class Packed:
    data: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    fmt: str

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes


def worth_quantizing(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.dtype != torch.float8_e4m3fn and t.numel() >= MIN_NUMEL


def _rows(t: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """The tensor as [groups, group_size]: one scale per group."""
    flat = t.detach().reshape(-1) if fmt == "int8_block" else t.detach().reshape(-1, t.shape[-1])
    if fmt != "int8_block":
        return flat
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block)


def quantize(t: torch.Tensor, fmt: str, block: int = 128) -> Packed:
    rows = _rows(t, fmt, block).float()
    # max |x| per group as max(max x, -min x): two plain reductions, twice as fast as an inf-norm.
    amax = torch.maximum(rows.amax(dim=1, keepdim=True), rows.amin(dim=1, keepdim=True).neg_())
    scale = amax.clamp_min_(1e-12).div_(FP8_MAX if fmt == "fp8_row" else 127.0)
    scaled = rows.mul(scale.reciprocal())  # one temporary, then in place
    data = scaled.to(torch.float8_e4m3fn) if fmt == "fp8_row" else scaled.round_().to(torch.int8)
    return Packed(data, scale, t.shape, t.dtype, fmt)


def dequantize(p: Packed) -> torch.Tensor:
    # int8 x fp32 promotes to fp32 inside one pass; float8 has no promotion rules, so it is widened first.
    rows = torch.mul(p.data.float() if p.fmt == "fp8_row" else p.data, p.scale)
    numel = 1
    for d in p.shape:
        numel *= d
    return rows.reshape(-1)[:numel].view(p.shape).to(p.dtype)
