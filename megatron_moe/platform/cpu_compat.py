"""CPU compatibility layer: what megatron-core 0.16.1 needs to train without CUDA.

megatron-core is written for CUDA. Each `Patch` (patch.py) below fixes one measured
breakage (docs/platform.md lists them), is applied only when CUDA
is absent, exactly once per process, and carries a `still_needed()` probe that
inspects megatron-core's source for the construct it works around. The unit
test `tests/unit/test_platform.py` asserts every probe is still true, so an
upgrade of megatron-core tells which patches can go.

Patches are narrow where the site is known (a module's own `torch` name, one
function); only `torch.cuda.*` stand-ins and `Tensor.cuda` are process-wide,
which is harmless on a machine where every one of them would raise anyway.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types

import torch

# Patch and the source probes live in patch.py; other folders still import them from here.
from megatron_moe.import_hooks import after_import
from megatron_moe.platform.layer_wise_gather import apply_layer_wise_gather, layer_wise_gathers_uneven_lists
from megatron_moe.platform.patch import Patch, source, source_sha256  # noqa: F401

_CPU = torch.device("cpu")


# ---------------------------------------------------------------------------
# 1. torch.cuda stand-ins: current_device, streams, events, synchronize.
# ---------------------------------------------------------------------------


class CpuEvent:
    """A CUDA event stand-in: CPU work is synchronous, so every event has happened."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event) -> float:
        return 0.0


class CpuStream:
    """A CUDA stream stand-in: one in-order CPU queue that is always drained."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else CpuEvent()

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_DEFAULT_STREAM = CpuStream()


def _cpu_device(*args, **kwargs) -> torch.device:
    return _CPU


def _noop(*args, **kwargs) -> None:
    return None


def _zero(*args, **kwargs) -> int:
    return 0


def _false(*args, **kwargs) -> bool:
    return False


_TORCH_CUDA_STANDINS: dict[str, object] = {
    # A CPU process on a host with GPUs (MEGATRON_MOE_FORCE_CPU=1) answers as a CPU-only host does.
    "is_available": _false,
    "device_count": _zero,
    "current_device": _cpu_device,
    "Stream": CpuStream,
    "Event": CpuEvent,
    "current_stream": lambda *a, **k: _DEFAULT_STREAM,
    "default_stream": lambda *a, **k: _DEFAULT_STREAM,
    "stream": lambda *a, **k: contextlib.nullcontext(),
    "set_stream": _noop,
    "synchronize": _noop,
    "empty_cache": _noop,
    "memory_allocated": _zero,
    "max_memory_allocated": _zero,
    "memory_reserved": _zero,
    "reset_peak_memory_stats": _noop,
}


def _apply_torch_cuda_standins() -> None:
    for name, standin in _TORCH_CUDA_STANDINS.items():
        setattr(torch.cuda, name, standin)
    # torch.compile (megatron-core's `jit_fuser`: the router's expert bias, the fused activations) asks dynamo's
    # CUDA interface, which took torch.cuda.is_available at import, whether to read the GPU's properties. With the
    # CPU forced on a GPU host it said yes, then indexed the properties by the stand-in current device (a
    # torch.device) and failed: "list indices must be integers or slices, not torch.device" (seen on an H200).
    # Told when dynamo loads (3 s of imports: not before a compile needs it).
    after_import("torch._dynamo.device_interface", _dynamo_sees_no_cuda)


def _dynamo_sees_no_cuda(device_interface) -> None:
    device_interface.CudaInterface.is_available = staticmethod(_false)


def _uses_torch_cuda_runtime() -> bool:
    return all(
        s in source(m)
        for m, s in [
            ("megatron.core.distributed.param_and_grad_buffer", "torch.cuda.current_device()"),
            ("megatron.core.transformer.moe.token_dispatcher", "torch.cuda.Stream("),
            ("megatron.core.pipeline_parallel.p2p_communication", "torch.cuda.synchronize()"),
            ("megatron.core.distributed.param_and_grad_buffer", "torch.cuda.default_stream()"),
        ]
    )


# ---------------------------------------------------------------------------
# 2. Tensor.cuda(): megatron-core moves some tensors explicitly (RoPE under
#    context parallelism, optimizer/checkpoint reload paths).
# ---------------------------------------------------------------------------


def _tensor_cuda_to_cpu(self, device=None, non_blocking=False, **kwargs):
    return self.to(_CPU, non_blocking=non_blocking)


def _apply_tensor_cuda() -> None:
    torch.Tensor.cuda = _tensor_cuda_to_cpu


def _uses_tensor_cuda() -> bool:
    return ".cuda(" in source("megatron.core.models.common.embeddings.rope_utils") and (
        ".cuda()" in source("megatron.core.optimizer.optimizer")
    )


# ---------------------------------------------------------------------------
# 3. RNG: the model-parallel RNG tracker and seeding drive the CUDA generator.
#    On CPU they drive the CPU default generator, so TP-region dropout still
#    forks a separate stream (CPU runs cannot reproduce GPU random streams).
# ---------------------------------------------------------------------------


def _get_cpu_rng_state(device=None, clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=None, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _seed_cpu_generator(seed: int) -> None:
    # Not torch.manual_seed: that also calls torch.cuda.manual_seed_all.
    torch.default_generator.manual_seed(int(seed))


def _apply_cpu_rng() -> None:
    from megatron.core.tensor_parallel import random as mc_random

    mc_random._get_cuda_rng_state = _get_cpu_rng_state
    mc_random._set_cuda_rng_state = _set_cpu_rng_state
    torch.cuda.manual_seed = _seed_cpu_generator
    torch.cuda.get_rng_state = _get_cpu_rng_state
    torch.cuda.set_rng_state = _set_cpu_rng_state


def _rng_uses_cuda_generator() -> bool:
    src = source("megatron.core.tensor_parallel.random")
    return "torch.cuda.default_generators" in src and "torch.cuda.manual_seed(" in src


# ---------------------------------------------------------------------------
# 4. Hard-coded device="cuda" / pin_memory=True in known modules. Each of these
#    modules gets its own `torch` name bound to a proxy whose tensor factories
#    map a CUDA device to the CPU; the rest of the process keeps plain torch.
# ---------------------------------------------------------------------------

_FACTORIES = (
    "tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "randn",
    "rand",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "as_tensor",
)

_DEVICE_LITERAL_MODULES = (
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.rerun_state_machine",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.transformer.utils",
)


def _is_cuda_device(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return factory


def _cpu_autocast(device_type, *args, **kwargs):
    return torch.autocast("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


class CpuTorchProxy(types.ModuleType):
    """`torch` as seen by one megatron-core module that hard-codes CUDA devices."""

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))
        self.autocast = _cpu_autocast

    def __getattr__(self, name):
        value = getattr(torch, name)
        setattr(self, name, value)  # cache: later lookups are plain attribute reads
        return value


def _apply_device_literals() -> None:
    proxy = CpuTorchProxy()
    for module_name in _DEVICE_LITERAL_MODULES:
        importlib.import_module(module_name).torch = proxy


def _has_device_literals() -> bool:
    return all("'cuda'" in src or '"cuda"' in src for src in (source(m) for m in _DEVICE_LITERAL_MODULES))


# ---------------------------------------------------------------------------
# 5. The optimizers assert `param.type()` is a `torch.cuda.*Tensor` while they
#    build their parameter groups. During those calls only, a CPU tensor
#    reports the CUDA type name of its dtype.
# ---------------------------------------------------------------------------

_TENSOR_TYPE = torch.Tensor.type
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _cuda_type_name(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is not None:
        return _TENSOR_TYPE(self, dtype, non_blocking, **kwargs)
    name = _TENSOR_TYPE(self)
    return _CUDA_TYPE_NAMES.get(name, name)


@contextlib.contextmanager
def _tensors_report_cuda_types():
    torch.Tensor.type = _cuda_type_name
    try:
        yield
    finally:
        torch.Tensor.type = _TENSOR_TYPE


def _report_cuda_types_during(owner, name: str, *also_bound_in) -> None:
    """Wrap `owner.name` (and the same object imported into `also_bound_in` modules)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        with _tensors_report_cuda_types():
            return original(*args, **kwargs)

    for target in (owner, *also_bound_in):
        setattr(target, name, wrapped)


def _apply_param_type_checks() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    _report_cuda_types_during(optimizer.Float16OptimizerWithFloat16Params, "__init__")
    _report_cuda_types_during(distrib_optimizer.DistributedOptimizer, "__init__")
    _report_cuda_types_during(clip_grads, "clip_grad_by_total_norm_fp32", optimizer)
    _report_cuda_types_during(clip_grads, "count_zeros_fp32", optimizer)


def _optimizers_check_cuda_types() -> bool:
    return all(
        "torch.cuda.FloatTensor" in source(module, attr)
        for module, attr in [
            ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),
            ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"),
            ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
        ]
    )


# ---------------------------------------------------------------------------
# 6. gloo cannot all_gather a list of unevenly sized tensors; the sequence-
#    parallel gather of the alltoall dispatcher (TP>1) does. Pad every rank's
#    piece to the largest, gather evenly, then trim.
# ---------------------------------------------------------------------------


def _gather_along_first_dim_gloo(input_, group, output_split_sizes=None, use_global_buffer=False):
    if output_split_sizes is None or group.size() == 1:
        return _ORIGINAL_GATHER(input_, group, None, use_global_buffer)
    longest = max(output_split_sizes)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    gathered = _ORIGINAL_GATHER(padded, group, None, False)
    pieces = gathered.split(longest, dim=0)
    return torch.cat([p[:n] for p, n in zip(pieces, output_split_sizes)], dim=0)


_ORIGINAL_GATHER = None


def _apply_uneven_gather() -> None:
    global _ORIGINAL_GATHER
    from megatron.core.tensor_parallel import mappings

    _ORIGINAL_GATHER = mappings._gather_along_first_dim
    mappings._gather_along_first_dim = _gather_along_first_dim_gloo


def _gathers_uneven_lists() -> bool:
    src = source("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim")
    return "torch.distributed.all_gather(output_tensor_list" in src


# ---------------------------------------------------------------------------
# 7. The alltoall dispatcher turns its split sizes into numpy only for CUDA
#    tensors; gloo's all_to_all_single rejects tensor split sizes.
# ---------------------------------------------------------------------------


def _move_tensor_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _apply_split_sizes_to_host() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _move_tensor_to_host
    token_dispatcher.maybe_move_tensor_to_cpu = _move_tensor_to_host


def _split_sizes_only_converted_on_cuda() -> bool:
    src = source("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu")
    return "tensor.is_cuda" in src


PATCHES: tuple[Patch, ...] = (
    Patch(
        "torch_cuda_standins",
        "~175 allocations use torch.cuda.current_device(); DDP, pipeline p2p and the "
        "alltoall dispatcher create streams/events and synchronize.",
        _apply_torch_cuda_standins,
        _uses_torch_cuda_runtime,
    ),
    Patch(
        "tensor_cuda_to_cpu",
        "Tensor.cuda() calls (RoPE context parallel, optimizer reload) move to the CPU.",
        _apply_tensor_cuda,
        _uses_tensor_cuda,
    ),
    Patch(
        "cpu_rng",
        "the model-parallel RNG tracker and seeding use the CUDA generator.",
        _apply_cpu_rng,
        _rng_uses_cuda_generator,
    ),
    Patch(
        "device_literals",
        'hard-coded device="cuda" / pin_memory=True in optimizer, clip_grads, '
        "schedules, checkpoint exchange and utils.",
        _apply_device_literals,
        _has_device_literals,
    ),
    Patch(
        "param_type_checks",
        "optimizers assert param.type() is torch.cuda.{Float,Half,BFloat16}Tensor.",
        _apply_param_type_checks,
        _optimizers_check_cuda_types,
    ),
    Patch(
        "uneven_gather_gloo",
        "gloo has no uneven list all_gather (alltoall dispatcher with TP>1).",
        _apply_uneven_gather,
        _gathers_uneven_lists,
    ),
    Patch(
        "split_sizes_to_host",
        "dispatcher split sizes stay tensors on CPU; gloo all_to_all_single wants lists.",
        _apply_split_sizes_to_host,
        _split_sizes_only_converted_on_cuda,
    ),
    Patch(
        "layer_wise_uneven_gather_gloo",
        "Muon's layer-wise distributed optimizer all-gathers unequal parameter shards; gloo wants equal sizes.",
        apply_layer_wise_gather,
        layer_wise_gathers_uneven_lists,
    ),
)

_applied = False


def apply_all() -> None:
    """Apply every patch once (idempotent). Only for processes without CUDA."""
    global _applied
    if _applied:
        return
    for patch in PATCHES:
        patch.apply()
    _applied = True


def is_applied() -> bool:
    return _applied
