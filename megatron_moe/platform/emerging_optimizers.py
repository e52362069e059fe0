# SPDX-FileCopyrightText: Copyright (c) 2025 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
# SPDX-License-Identifier: Apache-2.0
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
# http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""A stand-in for the parts of NVIDIA's `emerging_optimizers` that megatron-core 0.16.1's Muon imports.

megatron-core 0.16.1's optimizer/muon.py (`TensorParallelMuon`) subclasses its `OrthogonalizedOptimizer` and calls
`get_muon_scale_factor` and `muon_utils.newton_schulz_tp`; the package is not on PyPI. This is its v0.1.0 code
(github.com/NVIDIA-NeMo/Emerging-Optimizers, commit d5363b4a418128cd8111983b191c4b8869a9766b, the one Megatron-LM
core_v0.16.1 pins), ported as written for what 0.16.1 calls: `mixin.WeightDecayMixin`, `OrthogonalizedOptimizer`,
`get_muon_scale_factor`, `newton_schulz{,_tp,_step}` with `_COEFFICIENT_SETS`, `utils.fp32_matmul_precision`. Left
out: the Triton SYRK step (GPU only; `newton_schulz_tp` never asks for it) and absl logging. `install()` registers
it under the package's module names where the real package is absent (the Patch `emerging_optimizers_stand_in`,
platform/upstream_fixes.py); where the real package is installed, it is used instead.
Inputs: float32 tensors, parameter groups. Outputs: orthogonalized updates, parameters updated in place.
Invariant: v0.1.0's arithmetic, step for step.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import logging
import sys
import types
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed
import torch.optim as optim

log = logging.getLogger(__name__)

SOURCE_COMMIT = "d5363b4a418128cd8111983b191c4b8869a9766b"
"""Emerging-Optimizers v0.1.0, the commit Megatron-LM core_v0.16.1's uv.lock pins."""

WeightDecayT = Literal["decoupled", "independent", "l2"]

# ------------------------------------------------------------------------------------------------ utils


@contextmanager
def fp32_matmul_precision(precision: str = "highest") -> Generator[None, None, None]:
    """Context manager for setting the precision of matmuls (emerging_optimizers.utils)."""
    prev_val = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev_val)


# ------------------------------------------------------------------------------------------------ mixin


class WeightDecayMixin:
    """Weight decay (emerging_optimizers.mixin): "decoupled" applied to the parameter scaled by the learning rate,
    "independent" without it, "l2" added to the gradient."""

    def _apply_weight_decay_inplace(self, p: torch.Tensor, grad: torch.Tensor, lr: float, weight_decay: float) -> None:
        """Depends on the weight decay option, p or grad will be updated in place"""
        if weight_decay == 0.0:
            return
        weight_decay_method = getattr(self, "weight_decay_method", "l2")
        if weight_decay_method == "decoupled":
            p.add_(p, alpha=(-weight_decay * lr))
        elif weight_decay_method == "independent":
            p.add_(p, alpha=-weight_decay)
        elif weight_decay_method == "l2":
            grad.add_(p, alpha=weight_decay)
        else:
            raise ValueError(f"Invalid weight decay method: {weight_decay_method}")


# ------------------------------------------------------------------------------------------------ optimizer


class OrthogonalizedOptimizer(WeightDecayMixin, optim.Optimizer):
    """Base class for orthogonalized optimizers (emerging_optimizers.orthogonalized_optimizers): SGD with an EMA
    momentum (optionally Nesterov), weight decay, and the update orthogonalized by `scaled_orthogonalize_fn`
    (`orthogonalize`, which a subclass overrides) under `fp32_matmul_prec`."""

    def __init__(
        self,
        params,
        lr: float,
        momentum_beta: float,
        weight_decay: float,
        *,
        use_nesterov: bool,
        weight_decay_method: WeightDecayT,
        fp32_matmul_prec: str,
        scaled_orthogonalize_fn: Callable | None = None,
        **kwargs: Any,
    ):
        if scaled_orthogonalize_fn is None:
            log.warning("scaled_orthogonalize_fn not provided. Using noop")
            scaled_orthogonalize_fn = torch.nn.Identity()
        self.fp32_matmul_prec = fp32_matmul_prec
        self.use_nesterov = use_nesterov
        self.weight_decay_method = weight_decay_method
        default_args_dict = dict(lr=lr, momentum_beta=momentum_beta, weight_decay=weight_decay, **kwargs)
        super().__init__(params, default_args_dict)
        self.scaled_orthogonalize_fn = scaled_orthogonalize_fn

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs a single optimization step."""
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() == 1:
                    raise ValueError(f"{self.__class__.__name__} does not support 1D parameters")
                grad = p.grad
                if grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                exp_avg = state["momentum_buffer"]  # updated in place below
                self._apply_weight_decay_inplace(p, grad, group["lr"], group["weight_decay"])
                exp_avg.lerp_(grad, 1 - group["momentum_beta"])  # EMA of the gradient
                if self.use_nesterov:
                    grad = grad.lerp(exp_avg, group["momentum_beta"])
                else:
                    grad = exp_avg
                with fp32_matmul_precision(self.fp32_matmul_prec):
                    group_kwargs = {k: v for k, v in group.items() if k != "params"}
                    grad = self.orthogonalize(p, grad, **group_kwargs)
                p.add_(grad, alpha=-group["lr"])  # the scale makes the update's RMS what the scale mode says
        return loss

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Orthogonalize the momentum (a subclass may split fused parameters first)."""
        return self.scaled_orthogonalize_fn(grad)


def get_muon_scale_factor(size_out: int, size_in: int, mode: str = "spectral") -> float:
    """The scale of the orthogonalized update: "shape_scaling" sqrt(max(1, out/in)) (Keller Jordan's Muon),
    "spectral" sqrt(max(out, in)) (Kimi's, transfers AdamW's learning rate), "unit_rms_norm" sqrt(out/in)
    (Scion's)."""
    if mode == "shape_scaling":
        return max(1, size_out / size_in) ** 0.5
    elif mode == "spectral":
        return max(size_out, size_in) ** 0.5
    elif mode == "unit_rms_norm":
        return (size_out / size_in) ** 0.5
    else:
        raise ValueError(f"Invalid mode for Muon update scale factor: {mode}")


# ------------------------------------------------------------------------------------------------ Newton-Schulz

_COEFFICIENT_SETS = {
    "simple": [
        (3.4445, -4.7750, 2.0315),
    ],
    "quintic": [
        # optimized for a quintic iteration.
        # Source: https://leloykun.github.io/ponder/muon-opt-coeffs/#how-do-we-optimize-the-coefficients
        # Numbers from: https://github.com/KellerJordan/modded-nanogpt/blob/master/train_gpt_medium.py#L44
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "polar_express": [
        # Polar Express iteration from: https://arxiv.org/abs/2505.16932
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    "aol": [
        # from https://github.com/thib-s/flash-newton-schulz/blob/main/newton_schulz_triton.py#L511
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
}
COEFFICIENT_TYPES = tuple(_COEFFICIENT_SETS)
"""The coefficient sets v0.1.0 names (--muon-coefficient-type); --muon-num-ns-steps must be a multiple of a set's
length."""


def coefficient_set_length(coefficient_type: str) -> int:
    """How many steps one pass of a coefficient set takes (the number of Newton-Schulz steps is a multiple)."""
    return len(_COEFFICIENT_SETS[coefficient_type])


def distributed_normalize_p2(x: torch.Tensor, eps: float, group: torch.distributed.ProcessGroup) -> torch.Tensor:
    """Normalize a tensor in a distributed way."""
    x_sq_sum = (x * x).sum()
    torch.distributed.all_reduce(x_sq_sum, op=torch.distributed.ReduceOp.SUM, group=group)
    return x / torch.sqrt(x_sq_sum).clamp_min(eps)


def newton_schulz(
    x: torch.Tensor,
    steps: int,
    coefficient_type: str = "quintic",
    custom_coefficient_sets: list[tuple[float, float, float]] | None = None,
    eps: float = 1e-7,
    transpose: bool | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
    use_syrk: bool = False,
) -> torch.Tensor:
    """The orthogonalization of float32 `x` (about U V^T of its SVD U S V^T, singular values noisy around 1) by
    `steps` Newton-Schulz iterations of `coefficient_type` ("custom": `custom_coefficient_sets`), on the smaller
    dimension (`transpose`, None: picked by shape); `tp_group`: x is sharded along that smaller dimension. Under
    float32 matmul precision "medium" the iterations run in bfloat16. `use_syrk` (a Triton kernel) is refused."""
    if x.ndim < 2:
        raise ValueError("Input tensor x must have at least 2 dimensions since Muon is not for 1d parameters.")
    if x.dtype != torch.float32:
        raise ValueError(f"Input tensor x must be in float32, got {x.dtype}")
    if use_syrk:
        raise ValueError("use_syrk: the Triton SYRK kernel is not part of megatron_moe's stand-in")
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    # Ensure spectral norm is at most 1
    if tp_group is not None:
        X = distributed_normalize_p2(x, eps, tp_group)
    else:
        X = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=eps)
    if coefficient_type in _COEFFICIENT_SETS:
        coefficient_sets = _COEFFICIENT_SETS[coefficient_type]
    elif coefficient_type == "custom":
        if custom_coefficient_sets is None:
            raise ValueError("custom_coefficient_sets must be provided when coefficient_type is 'custom'.")
        coefficient_sets = custom_coefficient_sets
    else:
        raise ValueError(f"Invalid coefficient type: {coefficient_type}")
    if steps % len(coefficient_sets) != 0:
        raise ValueError(f"steps ({steps}) must be multiple of len(coefficient_sets) ({len(coefficient_sets)}).")
    if torch.get_float32_matmul_precision() == "medium":
        # PyTorch has no FP32 I/O BF16 compute kernels for precision "medium": convert to BF16 and back.
        X = X.to(torch.bfloat16)
    for i in range(steps):
        a, b, c = coefficient_sets[i % len(coefficient_sets)]
        X = newton_schulz_step(X, a, b, c, tp_group=tp_group)
    X = X.to(torch.float32)
    if transpose:
        X = X.mT
    return X


def newton_schulz_tp(
    x: torch.Tensor,
    steps: int,
    coefficient_type: str,
    tp_group: torch.distributed.ProcessGroup,
    partition_dim: int | None = None,
    mode: Literal["duplicated", "distributed"] = "duplicated",
) -> torch.Tensor:
    """Tensor-parallel Newton-Schulz of a shard `x` split along `partition_dim` over `tp_group` (None: not split,
    the plain path). "duplicated": the shards are all-gathered, each rank orthogonalizes the whole matrix and keeps
    its shard; "distributed": the iteration runs on the shards, its Gram matrices all-reduced (partition_dim must be
    the smaller dimension to save work)."""
    if partition_dim is None:
        return newton_schulz(x, steps, coefficient_type)
    kwargs: Any = {"steps": steps, "coefficient_type": coefficient_type}
    if mode == "duplicated":
        x_shards = [torch.empty_like(x) for _ in range(tp_group.size())]
        torch.distributed.all_gather(x_shards, x, tp_group)
        global_x = torch.cat(x_shards, dim=partition_dim)
        orthogonalized_x = newton_schulz(global_x, tp_group=None, **kwargs)
        output = orthogonalized_x.chunk(tp_group.size(), dim=partition_dim)[tp_group.rank()]
    elif mode == "distributed":
        if partition_dim == 0:
            transpose = True
        elif partition_dim == 1:
            transpose = False
        else:
            raise ValueError(f"Invalid partition_dim: {partition_dim}")
        output = newton_schulz(x, **kwargs, transpose=transpose, tp_group=tp_group)
    else:
        raise ValueError(f"Invalid mode: {mode}")
    return output


def newton_schulz_step(
    X: torch.Tensor, a: float, b: float, c: float, tp_group: torch.distributed.ProcessGroup | None = None
) -> torch.Tensor:
    """One step X <- a X + (b A + c A^2) X, A = X X^T (all-reduced over `tp_group` when X is sharded along its
    smaller dimension)."""
    A = X @ X.mT
    if tp_group is not None:
        torch.distributed.all_reduce(A, op=torch.distributed.ReduceOp.SUM, group=tp_group)
    B = torch.addmm(A, A, A, alpha=c, beta=b)
    X = torch.addmm(X, B, X, alpha=1.0, beta=a)
    return X


# ------------------------------------------------------------------------------------------------ install

PACKAGE = "emerging_optimizers"


def real_package_installed() -> bool:
    """Whether the real `emerging_optimizers` is on sys.path (the stand-in in sys.modules aside)."""
    return importlib.machinery.PathFinder.find_spec(PACKAGE) is not None


def install() -> bool:
    """Register this module as `emerging_optimizers.orthogonalized_optimizers[.muon_utils]` where the real package
    is absent, and re-import megatron-core's muon.py if it was imported without it (its `TensorParallelMuon` then
    derived from `object`). Returns whether the stand-in is in use."""
    if real_package_installed():
        return False
    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = []  # a package: its submodules below
        package.__megatron_moe_stand_in__ = SOURCE_COMMIT
        orthogonalized = types.ModuleType(f"{PACKAGE}.orthogonalized_optimizers")
        orthogonalized.__path__ = []
        orthogonalized.OrthogonalizedOptimizer = OrthogonalizedOptimizer
        orthogonalized.get_muon_scale_factor = get_muon_scale_factor
        muon_utils = types.ModuleType(f"{PACKAGE}.orthogonalized_optimizers.muon_utils")
        for name in ("newton_schulz", "newton_schulz_tp", "newton_schulz_step", "_COEFFICIENT_SETS"):
            setattr(muon_utils, name, globals()[name])
        orthogonalized.muon_utils = muon_utils
        package.orthogonalized_optimizers = orthogonalized
        sys.modules.update({m.__name__: m for m in (package, orthogonalized, muon_utils)})
    muon = sys.modules.get("megatron.core.optimizer.muon")
    if muon is not None and not muon.HAVE_EMERGING_OPTIMIZERS:
        importlib.reload(muon)
    return True
