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

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_NUMEL = 4096  # below this the scales and bookkeeping cost more than they save
MIN_ROW = 32  # narrower rows are not kept in a row format (the scale would be 1/8 of the bytes or more)
CPU_CHUNK_BYTES = 4 * 2**20  # fp32 rows quantized at a time on CPU (measured best of 1-8 MiB, 2 MiB L2 per core)


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


def worth_quantizing(t: torch.Tensor, fmt: str, numel: int | None = None) -> bool:
    """Whether `t` (a part of a tensor of `numel` elements, if given) is worth keeping in format `fmt`."""
    floating = t.is_floating_point() and t.dtype != torch.float8_e4m3fn
    narrow = fmt.endswith("_row") and t.dim() > 0 and t.shape[-1] < MIN_ROW  # a 4-byte scale per few values
    return floating and not narrow and t.numel() > 0 and (numel or t.numel()) >= MIN_NUMEL


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
    rows = _rows(t, fmt, block)
    fp8 = fmt == "fp8_row"
    data = torch.empty(rows.shape, dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=rows.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
    # On CPU, a few MiB of rows at a time: the five passes below then read from cache, not memory (2x faster
    # on 25 MB tensors). An accelerator takes the whole tensor in each kernel.
    step = max(1, CPU_CHUNK_BYTES // (rows.shape[1] * 4)) if rows.device.type == "cpu" else rows.shape[0]
    for start in range(0, rows.shape[0], step):
        part, part_scale = rows[start : start + step].float(), scale[start : start + step]
        # max |x| per group as max(max x, -min x): two plain reductions, twice as fast as an inf-norm.
        torch.maximum(part.amax(dim=1, keepdim=True), part.amin(dim=1, keepdim=True).neg_(), out=part_scale)
        part_scale.clamp_min_(1e-12).div_(FP8_MAX if fp8 else 127.0)
        scaled = part.mul(part_scale.reciprocal())  # one temporary, then in place; the copy converts
        data[start : start + step] = scaled if fp8 else scaled.round_()
    return Packed(data, scale, t.shape, t.dtype, fmt)


def dequantize(p: Packed) -> torch.Tensor:
    return dequantize_rows(p, 0, p.shape[0])  # never 0-d: see worth_quantizing


def dequantize_rows(p: Packed, start: int, end: int) -> torch.Tensor:
    """`dequantize(p)[start:end]` (slices of the first dim), touching only the groups that hold them."""
    numel = 1
    for d in p.shape:
        numel *= d
    per_row = numel // p.shape[0]
    lo, hi = start * per_row, end * per_row  # element range in the flat tensor
    width = p.data.shape[1]  # elements per scale group: a block, or the last dim
    g0, g1 = lo // width, -(-hi // width)
    # int8 x fp32 promotes to fp32 inside one pass; float8 has no promotion rules, so it is widened first.
    data = p.data[g0:g1]
    rows = torch.mul(data.float() if p.fmt == "fp8_row" else data, p.scale[g0:g1])
    flat = rows.reshape(-1)[lo - g0 * width : hi - g0 * width]
    return flat.view(end - start, *p.shape[1:]).to(p.dtype)
