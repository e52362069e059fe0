"""The platform layer: device choice, the CPU patches, the upstream fixes, the norms.

`test_patch_still_needed` is the upgrade alarm: each intervention's probe reads
megatron-core's source for the construct it works around or relies on (the CPU
patches, the upstream fixes, the comm taps, the overlap engine's subclass, class
swap and copy), so after an upgrade the failing cases name every intervention
that can be deleted or no longer fits.
"""

import datetime
import os
import subprocess
import sys

import pytest
import torch

from megatron_moe import overlap
from megatron_moe.comm import megatron_core
from megatron_moe.model import attention, partition
from megatron_moe.overlap import grad_reduce, install, linears
from megatron_moe.platform import cpu_compat, current_platform, init_platform, upstream_fixes
from megatron_moe.platform.norms import SequenceParallelNorm
from megatron_moe.training import muon

ALL_PATCHES = (
    cpu_compat.PATCHES
    + upstream_fixes.PATCHES
    + megatron_core.TAPS
    + overlap.PROBES
    + partition.PROBES
    + attention.PROBES
    + muon.PROBES
)
ON_GPU = current_platform().is_accelerator
cpu_only = pytest.mark.skipif(ON_GPU, reason="the CPU patches apply only without CUDA (MEGATRON_MOE_FORCE_CPU=1)")


@cpu_only
def test_cpu_platform_picks_gloo():
    platform = current_platform()
    assert platform.device.type == "cpu" and platform.backend == "gloo"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_gpu_platform_picks_nccl_and_leaves_torch_unpatched():
    platform = init_platform()
    assert platform.device == torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    assert platform.backend == "nccl" and platform.expert_chunk_bytes is None
    assert not cpu_compat.is_applied()
    assert torch.zeros(1, device="cuda").device.type == "cuda"


@pytest.mark.parametrize("patch", ALL_PATCHES, ids=lambda p: p.name)
def test_patch_still_needed(patch):
    what = "no longer needs patch" if patch.apply else "no longer fits the intervention"
    assert patch.still_needed(), f"megatron-core {what} {patch.name!r}: {patch.why}"


@pytest.mark.parametrize(
    "module, attr, changed",
    [
        (linears, "UPSTREAM_LINEAR_SHA256", "0" * 64),  # the upstream linear's text changed
        (grad_reduce, "_BUCKET_GROUP_READS", grad_reduce._BUCKET_GROUP_READS + ("self.renamed_upstream",)),
        (grad_reduce, "_DDP_READS", ("self.bucket_groups_renamed",)),
    ],
)
def test_an_upstream_change_fails_the_probe_of_the_intervention_it_breaks(monkeypatch, module, attr, changed):
    probes = {p.name: p for p in overlap.PROBES}
    name = "deferring_linear_copy" if module is linears else "planned_bucket_groups"
    assert probes[name].still_needed()
    monkeypatch.setattr(module, attr, changed)
    assert not probes[name].still_needed()


def test_the_class_swap_probe_reads_gpt_models_head(monkeypatch):
    (probe,) = install.PROBES
    assert probe.still_needed()
    monkeypatch.setattr(install, "source", lambda *args: "self.output_layer = SomethingElse(")
    assert not probe.still_needed()


def test_patch_names_unique_and_documented():
    names = [p.name for p in ALL_PATCHES]
    assert len(names) == len(set(names))
    assert all(p.why for p in ALL_PATCHES)


@cpu_only
def test_init_platform_is_idempotent():
    init_platform()
    current_device = torch.cuda.current_device
    init_platform()
    assert torch.cuda.current_device is current_device
    assert cpu_compat.is_applied()
    assert torch.cuda.current_device() == torch.device("cpu")


# A process with the CPU forced on a host with GPUs, imitated on this one: torch and dynamo's CUDA interface say
# CUDA is there, and triton is installed with its CUDA backend only, as on the H200 where megatron-core's
# torch.compile'd expert bias failed. dynamo asks `has_triton()` first when it compiles (cached from then on).
_FORCED_CPU_ON_A_GPU_HOST = """
import sys, types
import torch, torch.utils._triton as triton_utils
from torch._dynamo import device_interface
torch.cuda.is_available = lambda: True
device_interface.CudaInterface.is_available = staticmethod(lambda: True)
from megatron_moe.platform import init_platform
from megatron.core.jit import jit_fuser
platform = init_platform()
triton = types.ModuleType("triton")
triton.backends = types.ModuleType("triton.backends")
triton.backends.backends = {"nvidia": None}
sys.modules.update({"triton": triton, "triton.backends": triton.backends})
has_package, triton_utils.has_triton_package = triton_utils.has_triton_package, lambda: True
has_triton = triton_utils.has_triton()
del sys.modules["triton"], sys.modules["triton.backends"]
triton_utils.has_triton_package = has_package
scaled = jit_fuser(lambda x, bias: torch.sigmoid(x) + bias)
out = scaled(torch.zeros(4), torch.ones(4))
print(platform.device, torch.cuda.is_available(), has_triton, out.tolist())
"""


@cpu_only
def test_a_cpu_process_on_a_gpu_host_runs_megatron_cores_compiled_fusions():
    env = {**os.environ, "MEGATRON_MOE_FORCE_CPU": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _FORCED_CPU_ON_A_GPU_HOST], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "cpu False False [1.5, 1.5, 1.5, 1.5]", out.stdout


@cpu_only
def test_device_literals_map_to_cpu_only_in_patched_modules():
    init_platform()
    from megatron.core.optimizer import clip_grads

    t = clip_grads.torch.zeros(2, device="cuda", pin_memory=True)
    assert t.device.type == "cpu"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")  # the rest of the process keeps real torch


@cpu_only
def test_rng_tracker_forks_cpu_generator():
    init_platform()
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("stream", 123)
    torch.manual_seed(0)
    outside = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("stream"):
        forked = torch.rand(3)
    after = torch.rand(3)
    assert not torch.equal(outside, forked)
    assert torch.equal(outside, after)  # the default stream did not advance inside the fork


@cpu_only
def test_type_names_restored_after_optimizer_checks():
    init_platform()
    assert torch.zeros(1).type() == "torch.FloatTensor"
    with cpu_compat._tensors_report_cuda_types():
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_sequence_parallel_norm_matches_torch(normalization):
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        normalization=normalization,
        sequence_parallel=True,
        tensor_model_parallel_size=2,
    )
    norm = SequenceParallelNorm(config, 8, eps=1e-5)
    assert all(p.sequence_parallel for p in norm.parameters())
    x = torch.randn(4, 2, 8)
    reference = torch.nn.LayerNorm(8) if normalization == "LayerNorm" else torch.nn.RMSNorm(8, eps=1e-5)
    torch.testing.assert_close(norm(x), reference(x))


def test_unknown_normalization_is_rejected():
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    with pytest.raises(ValueError, match="--normalization='L2Norm'.*LayerNorm or RMSNorm"):
        SequenceParallelNorm(config, 8, normalization="L2Norm")


_FAULTS_PROBE = """
import ctypes, resource
ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: a fault is one 4 KiB page, not 2 MiB
import torch
from megatron_moe.platform.host_memory import keep_freed_host_memory
applied = keep_freed_host_memory()
def step():  # a training step in miniature: big buffers of two sizes and small tensors, all freed at the end
    big = torch.ones(16 * 2**20)  # 64 MiB: glibc would mmap it, touch it and munmap it
    small = big[:8] + 1
    other = torch.ones(4 * 2**20) * small[0]
    return float(other[-1])
def faults_of_one_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
for _ in range(3):
    faults_of_one_step()
print(applied, sum(faults_of_one_step() for _ in range(5)))
"""


@pytest.mark.parametrize("mode", ["reuse", "system"])
def test_host_allocator_reuses_freed_blocks(mode):
    """With `reuse` (the CPU default) five warm steps fault in less than half the pages glibc's default does.

    glibc's default maps and unmaps both buffers every step (5 x 20480 faults).
    Reuse serves them from the heap; a 64 MiB buffer still lands on fresh heap
    now and then (memalign slack keeps a block from fitting its own hole): up
    to three times in five steps when measured (49152 faults in one CI run),
    while the 16 MiB one came back every time. The probe turns transparent huge pages off for itself: a
    host with THP `always` (one CI run's) faults a 64 MiB block in 2 MiB pages, 53250 faults where 4 KiB
    pages give 81920 and more.
    """
    env = {**os.environ, "MEGATRON_MOE_HOST_ALLOCATOR": mode}
    out = subprocess.run([sys.executable, "-c", _FAULTS_PROBE], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    pages = (64 + 16) * 2**20 // 4096  # of both buffers, once
    if mode == "reuse":
        assert applied == "True" and int(faults) < 5 * pages // 2, out.stdout
    else:
        assert applied == "False" and int(faults) > 4 * pages, out.stdout


def test_host_allocator_bad_value_names_the_variable(monkeypatch):
    from megatron_moe.platform import host_memory

    monkeypatch.setenv(host_memory.ENV, "jemalloc")
    host_memory.keep_freed_host_memory.cache_clear()
    try:
        with pytest.raises(ValueError, match="MEGATRON_MOE_HOST_ALLOCATOR='jemalloc'.*reuse, system"):
            host_memory.keep_freed_host_memory()
    finally:
        host_memory.keep_freed_host_memory.cache_clear()


def test_every_group_initialize_model_parallel_makes_gets_its_timeout():
    """megatron-core made its expert data-parallel gloo group with torch's default (30 minutes), whatever
    distributed_timeout_minutes said; with the upstream fix every group it makes has the given timeout."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d

    upstream_fixes.apply_all()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(distributed_timeout_minutes=3)
        world = distributed_c10d._get_default_group()
        timeouts = {
            distributed_c10d._world.pg_names[group]: group._get_backend(torch.device("cpu")).options._timeout
            for group in distributed_c10d._world.pg_map
            if group is not world
        }
        expert_dp_gloo = parallel_state.get_expert_data_parallel_group_gloo()
        assert expert_dp_gloo in distributed_c10d._world.pg_map  # the group the fix is for is among them
        assert set(timeouts.values()) == {datetime.timedelta(minutes=3)}, timeouts
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_the_rank_rearrangement_without_einops_is_megatron_cores_example():
    """create_hierarchical_groups' docstring: 16 ranks, sizes [2, 2, 4] (upstream_fixes 3c, for several
    distributed-optimizer instances without einops)."""
    import numpy as np

    from megatron_moe.platform.upstream_fixes import HIERARCHY_PATTERN, _RankRearrange

    def level(sizes, i):
        l, u = int(np.prod(sizes[i + 1 :])), int(np.prod(sizes[:i]))
        return _RankRearrange.rearrange(np.arange(16), HIERARCHY_PATTERN, l=l, s=sizes[i], u=u).tolist()

    sizes = [2, 2, 4]
    assert level(sizes, 0)[:2] == [[0, 1], [2, 3]] and len(level(sizes, 0)) == 8
    assert level(sizes, 1)[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]] and len(level(sizes, 1)) == 8
    assert level(sizes, 2) == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
