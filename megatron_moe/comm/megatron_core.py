"""megatron-core's own collectives, routed through `issue` so a monitor sees them like ours, and its host reads
of device values in the forward, inside `host_read`.

megatron-core's code cannot be rewritten; README.md in this folder lists where its collectives happen. Four
taps, each a `Patch` probed against the shipped source: 1. DP gradient reduction and the distributed
optimizer's parameter all-gather (`dp_grad_reduce` / `other`, one collective per bucket group); 2. pipeline p2p
(`pp_p2p`); 3. every other torch.distributed collective, classified by process group (`tp`, `pp_p2p`, `other`),
not issued at all on a group of one rank (`ON_ONE_RANK`); 4. the language-model loss inside `host_read`.
Invariant: without a monitor installed every tapped call goes straight to the original.
What each tap wraps and why: docs/internals/comm.md.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pickle

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_moe.comm.core import (
    Collective,
    MonitoredWork,
    host_read,
    is_issuing,
    issue,
    nbytes,
    ring_wire_bytes,
)
from megatron_moe.platform.patch import Patch, source

TAPPED_FUNCTIONS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "all_gather_object",
    "broadcast_object_list",
)
"""torch.distributed's collectives a monitor sees by name. Not isend/irecv: `P2POp` checks its op is the
original function (tap 2 covers pipeline p2p)."""

# Modules that bound collectives to names of their own at import time.
ALIASES = {
    "megatron.core.tensor_parallel.mappings": ("dist_all_gather_func", "dist_reduce_scatter_func"),
    "megatron.core.tensor_parallel.layers": ("dist_all_gather_func", "dist_reduce_scatter_func"),
    "megatron.core.distributed.param_and_grad_buffer": ("dist_all_gather_func", "dist_reduce_scatter_func"),
}


# ---------------------------------------------------------------------------
# 1. DP gradient reduction / parameter all-gather: the bucket groups.
# ---------------------------------------------------------------------------


def _bucket_group_class():
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    return _ParamAndGradBucketGroup


def _sync_group(bucket_group):
    if bucket_group.ddp_config.use_distributed_optimizer:
        return bucket_group.intra_distributed_optimizer_instance_group
    return bucket_group.data_parallel_group


def _bucket_bytes(bucket_group, attr: str) -> int:
    """What the sync sends: its buckets' data, none over a group of one rank (expert buckets when every
    expert lives on one data-parallel rank)."""
    if dist.get_world_size(_sync_group(bucket_group)) == 1:
        return 0
    return sum(nbytes(getattr(bucket, attr)) for bucket in bucket_group.buckets)


def _tap_sync(original, handle_attr: str, kind: str, data_attr: str):
    """Issue `original(self, ...)` as one collective; an asynchronous handle it leaves in `handle_attr`
    is replaced by its monitored version (megatron-core waits on it in finish_*_sync)."""

    @functools.wraps(original)
    def sync(self, *args, **kwargs):
        if getattr(self, handle_attr) is not None or is_issuing():
            return original(self, *args, **kwargs)  # waits on (or skips for) a handle already monitored

        def start():
            original(self, *args, **kwargs)
            return getattr(self, handle_attr)

        purpose = f"megatron-core/{original.__name__}"
        sent, p = _bucket_bytes(self, data_attr), dist.get_world_size(_sync_group(self))
        # The gradients: reduce-scatter (distributed optimizer) or all-reduce; the parameters: all-gather.
        all_reduce = kind == "dp_grad_reduce" and not self.ddp_config.use_distributed_optimizer
        wire = ring_wire_bytes(sent, p, all_reduce=all_reduce)
        record = Collective(kind, purpose, _sync_group(self), nbytes=sent, wire_bytes=wire)
        handle = issue(record, start)
        if handle is not None:
            setattr(self, handle_attr, handle)

    sync.__tapped__ = original
    return sync


def _apply_bucket_taps() -> None:
    cls = _bucket_group_class()
    if hasattr(cls.start_grad_sync, "__tapped__"):
        return
    cls.start_grad_sync = _tap_sync(cls.start_grad_sync, "grad_reduce_handle", "dp_grad_reduce", "grad_data")
    cls.start_param_sync = _tap_sync(cls.start_param_sync, "param_gather_handle", "other", "param_data")


def _buckets_keep_their_handles() -> bool:
    src = source("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup")
    return all(
        s in src
        for s in (
            "def start_grad_sync(",
            "self.grad_reduce_handle = cm",
            "self.grad_reduce_handle.wait()",
            "def start_param_sync(",
            "self.param_gather_handle = cm",
        )
    )


# ---------------------------------------------------------------------------
# 2. Pipeline p2p.
# ---------------------------------------------------------------------------


def _apply_p2p_taps() -> None:
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    for name in ("_p2p_ops", "_batched_p2p_ops"):
        if not hasattr(getattr(p2p, name), "__tapped__"):
            setattr(p2p, name, _tap_requests(getattr(p2p, name)))


def _tap_requests(original):
    """`_p2p_ops` / `_batched_p2p_ops`: issued as one `pp_p2p` collective; each returned request is monitored."""

    @functools.wraps(original)
    def p2p(*args, **kwargs):
        if is_issuing():
            return original(*args, **kwargs)
        # Keyword-only in megatron-core: tensor_send_prev/_next, tensor_recv_prev/_next, group, ranks.
        sent = sum(nbytes(kwargs[k]) for k in ("tensor_send_prev", "tensor_send_next") if kwargs.get(k) is not None)
        record = Collective("pp_p2p", f"megatron-core/{original.__name__}", kwargs.get("group"), nbytes=sent)
        started = []

        def start():
            started.append(original(*args, **kwargs))
            return _Requests(started[0]) if started[0] else None

        handle = issue(record, start)
        requests = started[0]
        if not isinstance(handle, MonitoredWork):
            return requests
        # Waiting on any request waits on the monitored whole: the first wait blocks, the others return.
        if isinstance(requests, dict):
            return {key: _Part(handle) for key in requests}
        return [_Part(handle) for _ in requests]

    p2p.__tapped__ = original
    return p2p


class _Requests:
    """A p2p call's requests as one handle."""

    def __init__(self, requests):
        self._requests = list(requests.values()) if isinstance(requests, dict) else list(requests)

    def wait(self):
        for request in self._requests:
            request.wait()

    def is_completed(self) -> bool:
        return all(request.is_completed() for request in self._requests)


class _Part:
    """One of the requests: waits on the monitored whole."""

    def __init__(self, whole: MonitoredWork):
        self._whole = whole

    def wait(self):
        return self._whole.wait()

    def is_completed(self) -> bool:
        return self._whole.is_completed()


def _p2p_ops_are_module_globals() -> bool:
    src = source("megatron.core.pipeline_parallel.p2p_communication")
    return "p2p_func = _batched_p2p_ops" in src and "p2p_func = _p2p_ops" in src and "req.wait()" in src


# ---------------------------------------------------------------------------
# 3. Everything else: torch.distributed's collectives, by process group.
# ---------------------------------------------------------------------------


def group_kind(group) -> str:
    """What a megatron-core collective on `group` is for, by the group (see the module docstring)."""
    if group is None:
        return "other"
    tensor_parallel = (
        parallel_state.get_tensor_model_parallel_group(check_initialized=False),
        parallel_state.get_expert_tensor_parallel_group(check_initialized=False),
    )
    if any(group is g for g in tensor_parallel if g is not None):
        return "tp"
    if group is parallel_state.get_pipeline_model_parallel_group(check_initialized=False):
        return "pp_p2p"
    return "other"


def _copy(out: str, source: str):
    """The one-rank result of a gather, scatter or all-to-all: argument `out` <- argument `source` (a list: its
    only entry)."""

    def local(a: dict) -> None:
        target, value = a[out], a[source]
        if isinstance(target, list | tuple):
            if not target:  # gather / scatter: only the root passes the list
                return
            target = target[0]
        if isinstance(value, list | tuple):
            value = value[0]
        target.copy_(value.reshape(target.shape))

    return local


def _gather_object(a: dict) -> None:
    a["object_list"][0] = pickle.loads(pickle.dumps(a["obj"]))  # a copy, as the real exchange makes


def _nothing(a: dict) -> None:
    pass


ON_ONE_RANK = {
    **dict.fromkeys(("all_reduce", "broadcast", "reduce", "barrier", "broadcast_object_list"), _nothing),
    "all_gather_into_tensor": _copy("output_tensor", "input_tensor"),
    "_all_gather_base": _copy("output_tensor", "input_tensor"),
    "reduce_scatter_tensor": _copy("output", "input"),
    "_reduce_scatter_base": _copy("output", "input"),
    "all_gather": _copy("tensor_list", "tensor"),
    "all_to_all": _copy("output_tensor_list", "input_tensor_list"),
    "all_to_all_single": _copy("output", "input"),
    "gather": _copy("gather_list", "tensor"),
    "scatter": _copy("tensor", "scatter_list"),
    "all_gather_object": _gather_object,
}
"""Each tapped function's result on a group of one rank, done locally: a reduction or broadcast leaves its tensor
as it is; a gather, scatter or all-to-all copies its input to its output."""
assert set(ON_ONE_RANK) == set(TAPPED_FUNCTIONS)


class _Done:
    """The work handle of a collective done locally (async_op=True): already complete."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(None)
        return future


def one_rank(group) -> bool:
    """True for a group of one rank (None: the world) outside a coalescing block (megatron-core's bucket syncs
    start their collectives inside one: there each must be issued, or the block ends without them)."""
    from torch.distributed import distributed_c10d

    if dist.get_world_size(group) != 1:
        return False
    group = distributed_c10d._get_default_group() if group is None else group
    return group not in distributed_c10d._world.pg_coalesce_state


def _tap_function(original):
    signature = inspect.signature(original)
    names = list(signature.parameters)
    group_at = names.index("group") if "group" in names else None
    sent = next((n for n in ("tensor", "input_tensor", "input") if n in names), None)
    sent_at = names.index(sent) if sent else None
    local = ON_ONE_RANK[original.__name__]

    @functools.wraps(original)
    def collective(*args, **kwargs):
        if is_issuing():
            return original(*args, **kwargs)
        group = kwargs.get("group", args[group_at] if group_at is not None and len(args) > group_at else None)
        if one_rank(group):  # nothing to exchange: not issued, not timed
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            local(bound.arguments)
            return _Done() if bound.arguments.get("async_op") else None
        tensor = kwargs.get(sent, args[sent_at] if sent_at is not None and len(args) > sent_at else None)
        size = nbytes(tensor) if hasattr(tensor, "element_size") else 0
        record = Collective(group_kind(group), f"torch.distributed.{original.__name__}", group, nbytes=size)
        return issue(record, lambda: original(*args, **kwargs))

    collective.__tapped__ = original
    return collective


def _apply_function_taps() -> None:
    tapped = {}
    for name in TAPPED_FUNCTIONS:
        original = getattr(dist, name)
        if not hasattr(original, "__tapped__"):
            setattr(dist, name, _tap_function(original))
        tapped[getattr(dist, name).__tapped__] = getattr(dist, name)
    for module_name, aliases in ALIASES.items():
        module = importlib.import_module(module_name)
        for alias in aliases:
            original = getattr(module, alias)
            if original in tapped:
                setattr(module, alias, tapped[original])


def _aliases_bound_at_import() -> bool:
    return all(
        f"{alias} = torch.distributed." in source(module) for module, aliases in ALIASES.items() for alias in aliases
    )


# ---------------------------------------------------------------------------
# 4. The language-model loss: a host read in every last-stage forward.
# ---------------------------------------------------------------------------

LOSS_READ = "megatron-core cross-entropy (target mask)"


def _apply_loss_read_tap() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.compute_language_model_loss
    if hasattr(original, "__tapped__"):
        return

    @functools.wraps(original)
    def compute_language_model_loss(self, *args, **kwargs):
        with host_read(LOSS_READ):
            return original(self, *args, **kwargs)

    compute_language_model_loss.__tapped__ = original
    LanguageModule.compute_language_model_loss = compute_language_model_loss


def _loss_reads_a_mask_on_the_host() -> bool:
    module = "megatron.core.models.common.language_module.language_module"
    return "def compute_language_model_loss(" in source(module) and "masked_target[target_mask] = 0" in source(
        "megatron.core.tensor_parallel.cross_entropy"
    )


TAPS: tuple[Patch, ...] = (
    Patch(
        "bucket_sync_tap",
        "DDP's bucket all-reduce / reduce-scatter and the parameter all-gather run inside megatron-core's "
        "bucket groups, coalesced: tapped as one collective per bucket group.",
        _apply_bucket_taps,
        _buckets_keep_their_handles,
    ),
    Patch(
        "p2p_tap",
        "pipeline send/recv are built from P2POp objects that must hold the original isend/irecv.",
        _apply_p2p_taps,
        _p2p_ops_are_module_globals,
    ),
    Patch(
        "function_tap",
        "megatron-core calls torch.distributed's collectives by module attribute, and through aliases bound "
        "when its modules were imported.",
        _apply_function_taps,
        _aliases_bound_at_import,
    ),
    Patch(
        "loss_read_tap",
        "megatron-core's cross-entropy indexes with a boolean mask of the targets: on a GPU the host waits for "
        "the device there, in every last-stage forward, and on NCCL a collective a peer never joined shows there.",
        _apply_loss_read_tap,
        _loss_reads_a_mask_on_the_host,
    ),
)


def tap_megatron_core() -> None:
    """Route megatron-core's collectives through `issue`, and its loss's host read through `host_read`
    (idempotent)."""
    for tap in TAPS:
        tap.apply()
