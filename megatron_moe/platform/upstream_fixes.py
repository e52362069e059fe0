"""Fixes for megatron-core 0.16.1 bugs that bite on every device, applied at start-up.

Like the CPU patches, each is a named `Patch` whose `still_needed()` probe
reads megatron-core's source, so `tests/unit/test_platform.py` says when an
upgrade has fixed it upstream.
"""

from __future__ import annotations

import datetime
import functools
import os
import re
import sys
import time
from multiprocessing import get_context
from multiprocessing.managers import SyncManager

import torch

from megatron_moe.import_hooks import JIT_MODULE
from megatron_moe.lifetime import writer_process_start
from megatron_moe.platform.patch import Patch, source


# 1. Without transformer-engine, moe_utils never binds `te_general_gemm`, and
#    the router's gating GEMM raises NameError.
def _apply_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _router_needs_te_general_gemm() -> bool:
    src = source("megatron.core.transformer.moe.moe_utils")
    return "te_general_gemm is not None" in src and "te_general_gemm = None" not in src


# 2. The experts' RowParallelLinear "reduces" (or reduce-scatters, under
#    sequence parallelism) over its expert-TP group even when that group has
#    one rank (EP=1, or TP>1 with expert-TP=1), through an autograd Function that
#    returns its input as-is; MLP then adds the expert bias in place on that
#    output, which autograd forbids ("Output 0 of _ReduceFromModelParallelRegion
#    is a view ..."). Either collective over one rank is the identity, so the
#    Function is skipped there.
def _identity_on_one_rank(collective):
    from megatron.core.tensor_parallel import mappings

    @functools.wraps(collective)
    def wrapped(input_, group=None, *args, **kwargs):
        if mappings.get_tensor_model_parallel_group_if_none(group).size() == 1:
            return input_
        return collective(input_, group, *args, **kwargs)

    return wrapped


def _apply_single_rank_reduce() -> None:
    from megatron.core.tensor_parallel import layers, mappings

    for name in ("reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region"):
        setattr(layers, name, _identity_on_one_rank(getattr(mappings, name)))


def _mlp_adds_bias_in_place() -> bool:
    return "output += output_bias" in source("megatron.core.transformer.mlp", "MLP")


# 3. Without apex/transformer-engine the distributed optimizer keeps torch Adam's
#    per-parameter "step" in its state, but the "fully_reshardable" checkpoint
#    format stores step once per param group (restored by load_state_dict) and
#    not beside exp_avg/exp_avg_sq; loading then fails with KeyError: 'step'.
#    Keep the step load_state_dict already restored.
#    That restore also hands every parameter's state the *same* step tensor, which
#    torch Adam then increments in place once per parameter per step: after a
#    resume the bias correction is wrong. Give each parameter its own copy.
def _apply_reshardable_step() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    load_state_dict = DistributedOptimizer.load_state_dict

    @functools.wraps(load_state_dict)
    def load_state_dict_with_own_steps(self, state_dict):
        result = load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        return result

    DistributedOptimizer.load_state_dict = load_state_dict_with_own_steps

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


def _reshardable_load_copies_every_state_key() -> bool:
    src = source("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer")
    return (
        "for key in dst_tensors:" in src
        and "dst_tensors[key].copy_(tensors[key])" in src
        and 's["step"] = step' in src  # one tensor shared by every parameter's state
    )


# 3b. The fully_reshardable save reads each parameter's state at its offset in the gradient buffer
#    (`param_index_map`, which counts the padding at the end of every bucket) from world tensors that
#    `get_parameter_state_dp_zero` packs bucket after bucket with that padding cut out. With more than one
#    bucket (--overlap-grad-reduce with a bucket size under the model, the adaptive partition's one bucket per
#    parameter) every parameter after the first bucket is saved with another's main weights and moments (a
#    resume then trains differently; the weights themselves are saved right). Put each bucket back at its
#    offset in the buffer: the same world tensors, laid out as the offsets they are read at. Megatron-LM fixed
#    it after 0.16.1 (NVIDIA/Megatron-LM#5077, offsets rebased instead); loading was never affected.
def _apply_reshardable_bucket_offsets() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.sharded_param_state_fully_reshardable

    @functools.wraps(original)
    def sharded_param_state_fully_reshardable(self, *args, **kwargs):
        self.get_parameter_state_dp_zero = functools.partial(_dp_zero_state_at_buffer_offsets, self)
        try:
            return original(self, *args, **kwargs)
        finally:
            del self.get_parameter_state_dp_zero  # the instance attribute only shadowed the method

    DistributedOptimizer.sharded_param_state_fully_reshardable = sharded_param_state_fully_reshardable


def _dp_zero_state_at_buffer_offsets(optimizer, *args, **kwargs):
    """megatron-core's `get_parameter_state_dp_zero(*args, **kwargs)` with each buffer's world tensors laid out
    as the buffer: bucket i at `buckets[i].offset` (its own end padding left as zeros)."""
    state = type(optimizer).get_parameter_state_dp_zero(optimizer, *args, **kwargs)
    if state is None:
        return None
    for gbuf_idx, by_dtype in state.items():
        if gbuf_idx == "buckets_coalesced":
            continue
        buckets = optimizer.buffers[gbuf_idx].buckets
        for world_tensors in by_dtype.values():
            for key in ("param", "exp_avg", "exp_avg_sq"):
                if key not in world_tensors:
                    continue  # a DP rank the state is not returned on
                packed = world_tensors[key]
                placed = packed.new_zeros(max(b.offset + b.numel_unpadded for b in buckets))
                start = 0
                for bucket in buckets:
                    placed[bucket.offset : bucket.offset + bucket.numel_unpadded] = packed[
                        start : start + bucket.numel_unpadded
                    ]
                    start += bucket.numel_unpadded
                world_tensors[key] = placed
    return state


def _reshardable_save_reads_packed_buckets_at_buffer_offsets() -> bool:
    src = source("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer")
    return (
        "offset_in_world_tensors += gbuf_world_numel_unpadded" in src
        and "world_tensors[state_key][param_world_start:param_world_end]" in src
    )


# 3c. Several distributed-optimizer instances (--num-distributed-optimizer-instances) make megatron-core build its
#    hierarchical data-parallel groups with einops, an optional package of its (its "dev" extra), for one
#    pattern: a reshape and a transpose of the rank list. Without einops, that pattern with numpy.
HIERARCHY_PATTERN = "(l s u) -> (l u) s"


class _RankRearrange:
    """einops' `rearrange` for megatron-core's one use in parallel_state (`HIERARCHY_PATTERN`) only."""

    @staticmethod
    def rearrange(ranks, pattern: str, *, l: int, s: int, u: int):  # noqa: E741 (einops' axis names)
        assert pattern == HIERARCHY_PATTERN, pattern
        return ranks.reshape(l, s, u).transpose(0, 2, 1).reshape(l * u, s)


def _apply_rank_rearrange() -> None:
    from megatron.core import parallel_state

    if not parallel_state.HAVE_EINOPS:
        parallel_state.einops, parallel_state.HAVE_EINOPS = _RankRearrange(), True


def _hierarchical_groups_use_einops_for_one_pattern() -> bool:
    src = source("megatron.core.parallel_state", "create_hierarchical_groups")
    return "einops.rearrange(" in src and f'"{HIERARCHY_PATTERN}"' in src and src.count("einops.") == 1


# 4. The torch_dist save strategy writes through processes that outlive a killed rank (seen: 37 minutes,
#    274 MB): a spawned multiprocessing Manager holding the results queue (module-global, started at the
#    first save, shut down only by a normal interpreter exit: never after os._exit or SIGKILL) and, in
#    every save, forked writer processes. Each now dies with its rank (parent-death signal) and leaves
#    torchrun's SIGTERM to the rank (megatron_moe.lifetime.writer_process_start).
WRITER_PAUSE_ENV = "MEGATRON_MOE_TEST_WRITER_PAUSE_S"  # test only: seconds each writer process waits first


def _apply_writer_lifetime() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def get_write_results_queue():
        if filesystem_async._results_queue is None:  # what megatron-core builds, its server started our way
            manager = SyncManager(ctx=get_context("spawn"))
            manager.start(initializer=writer_process_start, initargs=(os.getpid(),))
            filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
        return filesystem_async._results_queue

    write = filesystem_async.FileSystemWriterAsync.write_preloaded_data

    @functools.wraps(write)
    def write_preloaded_data(*args, **kwargs):  # runs in the forked writer: its parent is the rank
        writer_process_start()
        if pause := float(os.environ.get(WRITER_PAUSE_ENV, 0)):
            print(f"{WRITER_PAUSE_ENV}: writer {os.getpid()} pauses {pause} s", file=sys.stderr, flush=True)
            time.sleep(pause)
        return write(*args, **kwargs)

    filesystem_async._get_write_results_queue = get_write_results_queue
    filesystem_async.FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)


def _writer_processes_outlive_their_rank() -> bool:
    src = source("megatron.core.dist_checkpointing.strategies.filesystem_async")
    return "ctx.Manager().Queue()" in src and 'mp.get_context("fork")' in src and "PDEATHSIG" not in src


# 5. initialize_model_parallel gives its `distributed_timeout_minutes` to every group it creates but two: the
#    expert data-parallel gloo group (the distributed optimizer's host-side group for expert parameters) and the
#    hybrid DP x CP groups get torch's default, 30 minutes, so a stopped peer there is waited for 30 minutes
#    whatever --distributed-timeout-minutes says. Inside initialize_model_parallel, a group created without a
#    timeout gets the one the call was given.
def _apply_group_timeouts() -> None:
    from megatron.core import parallel_state

    given: dict[str, datetime.timedelta] = {}
    create_group, initialize_model_parallel = parallel_state.create_group, parallel_state.initialize_model_parallel

    @functools.wraps(create_group)
    def create_group_with_timeout(ranks=None, timeout=None, *args, **kwargs):
        return create_group(ranks, timeout if timeout is not None else given.get("timeout"), *args, **kwargs)

    @functools.wraps(initialize_model_parallel)
    def initialize_with_timeout(*args, distributed_timeout_minutes: int = 30, **kwargs):
        given["timeout"] = datetime.timedelta(minutes=distributed_timeout_minutes)
        try:
            return initialize_model_parallel(*args, distributed_timeout_minutes=distributed_timeout_minutes, **kwargs)
        finally:
            given.clear()

    parallel_state.create_group = create_group_with_timeout
    parallel_state.initialize_model_parallel = initialize_with_timeout


def _groups_made_without_the_timeout() -> bool:
    calls = re.findall(r"create_group\((.*?)\)\n", source("megatron.core.parallel_state"), re.S)
    return any("timeout" not in call for call in calls)


# 6. multi_latent_attention.py sets HAVE_TE when `megatron.core.extensions.transformer_engine` imports, which it
#    also does without transformer-engine (its classes then derive from MagicMock stand-ins): MLASelfAttention's
#    `isinstance(self.linear_proj, TELinear)` then raises TypeError, so MLA cannot be built without it. Its flag
#    follows the extension's own HAVE_TE (transformer-engine imported).
def _apply_mla_have_te() -> None:
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = multi_latent_attention.HAVE_TE and transformer_engine.HAVE_TE


def _mla_trusts_the_extension_import() -> bool:
    src = source("megatron.core.transformer.multi_latent_attention")
    return "isinstance(self.linear_proj, TELinear)" in src and "transformer_engine.HAVE_TE" not in src


# 7. megatron-core's Muon (optimizer/muon.py: TensorParallelMuon, get_megatron_muon_optimizer) needs NVIDIA's
#    emerging_optimizers, which is not on PyPI: without it TensorParallelMuon derives from `object` and
#    get_megatron_muon_optimizer asserts. The stand-in (platform/emerging_optimizers.py, that package's v0.1.0 code
#    that Megatron-LM core_v0.16.1 pins) under its module names; the real package, when installed, is used.
def _apply_emerging_optimizers_stand_in() -> None:
    from megatron_moe.platform import emerging_optimizers

    emerging_optimizers.install()


def _muon_needs_emerging_optimizers_and_it_is_absent() -> bool:
    from megatron_moe.platform import emerging_optimizers

    src = source("megatron.core.optimizer.muon")
    needs = "from emerging_optimizers.orthogonalized_optimizers import" in src and "newton_schulz_tp" in src
    return needs and not emerging_optimizers.real_package_installed()


def _apply_eager_optim() -> None:
    from megatron_moe.platform import eager_optim

    eager_optim.install()


def _optim_guards_import_dynamo() -> bool:
    from megatron_moe.platform import eager_optim

    return eager_optim.still_needed()


def _jit_fuser_is_torch_compile() -> bool:
    return "jit_fuser = torch.compile" in source(JIT_MODULE)


PATCHES: tuple[Patch, ...] = (
    Patch(
        "deferred_jit_fuser",
        "megatron-core decorates ~40 functions with torch.compile as it loads (3.5 s of dynamo and inductor imports "
        "per process): they compile on first call instead (megatron_moe/import_hooks.py, installed on import).",
        None,
        _jit_fuser_is_torch_compile,
    ),
    Patch(
        "eager_torch_optim",
        "torch.optim's guards against tracing import all of dynamo on first use (1.3 s of CPU per training "
        "process) for no-ops outside torch.compile: they run eager until dynamo is loaded (platform/eager_optim.py).",
        _apply_eager_optim,
        _optim_guards_import_dynamo,
    ),
    Patch(
        "te_general_gemm",
        "router gating raises NameError te_general_gemm without transformer-engine.",
        _apply_te_general_gemm,
        _router_needs_te_general_gemm,
    ),
    Patch(
        "single_rank_tp_reduce",
        "expert bias added in place on a 1-rank reduce/reduce-scatter's aliased output.",
        _apply_single_rank_reduce,
        _mlp_adds_bias_in_place,
    ),
    Patch(
        "reshardable_optimizer_step",
        "distributed optimizer fully_reshardable load: KeyError 'step' without apex/TE.",
        _apply_reshardable_step,
        _reshardable_load_copies_every_state_key,
    ),
    Patch(
        "reshardable_bucket_offsets",
        "distributed optimizer fully_reshardable save: with several buckets, parameters get another's state.",
        _apply_reshardable_bucket_offsets,
        _reshardable_save_reads_packed_buckets_at_buffer_offsets,
    ),
    Patch(
        "hierarchical_groups_without_einops",
        "--num-distributed-optimizer-instances > 1: megatron-core's hierarchical groups need einops (ImportError).",
        _apply_rank_rearrange,
        _hierarchical_groups_use_einops_for_one_pattern,
    ),
    Patch(
        "model_parallel_group_timeouts",
        "megatron-core's expert data-parallel gloo group ignores distributed_timeout_minutes (waits 30 min).",
        _apply_group_timeouts,
        _groups_made_without_the_timeout,
    ),
    Patch(
        "checkpoint_writer_lifetime",
        "dist_checkpointing's writer processes (Manager, forked writers) outlive a killed rank.",
        _apply_writer_lifetime,
        _writer_processes_outlive_their_rank,
    ),
    Patch(
        "mla_without_transformer_engine",
        "MLASelfAttention raises TypeError without transformer-engine (isinstance of a MagicMock stand-in).",
        _apply_mla_have_te,
        _mla_trusts_the_extension_import,
    ),
    Patch(
        "emerging_optimizers_stand_in",
        "--optimizer muon: megatron-core's Muon imports emerging_optimizers, not on PyPI (its v0.1.0 code stands in).",
        _apply_emerging_optimizers_stand_in,
        _muon_needs_emerging_optimizers_and_it_is_absent,
    ),
)

_applied = False


def apply_all() -> None:
    """Apply every fix once (idempotent)."""
    global _applied
    if not _applied:
        for patch in PATCHES:
            if patch.apply:  # None: applied by its owner (the deferred jit_fuser: on import)
                patch.apply()
        _applied = True
