"""In one process: the experts' initial weights come from (seed, layer, expert) alone.

Here also EP and ESP ranks imitated (fake groups) under megatron-core's expert-parallel fork, with the tracker
as on a GPU, and on a real GPU (marked gpu). Real layouts across ranks: tests/distributed/test_expert_init.py.
"""

import contextlib
import functools

import pytest
import torch
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

from megatron_moe import comm
from megatron_moe.config import parse_args
from megatron_moe.model.builder import moe_layer
from megatron_moe.moe import MoELayerConfig
from megatron_moe.moe.experts import FFNExperts
from megatron_moe.platform import current_platform
from megatron_moe.platform.rng import expert_parallel_stream, host_rng_keyed, keyed_seed
from tests.unit.gpu_emulation import device_generator_apart

ON_GPU = current_platform().is_accelerator
SIZES = dict(num_local_experts=4, hidden_size=16, ffn_hidden_size=24, gated=True)


def experts(init_seed=1234, layer_number=1) -> FFNExperts:
    def init(w):
        return torch.nn.init.normal_(w, std=0.02)

    return FFNExperts(
        **SIZES, init_method=init, output_init_method=init, init_seed=init_seed, layer_number=layer_number
    )


def test_the_run_seed_reaches_the_layer():
    flags = ["--data-path", "d", "--tokenizer-model", "t.model", "--num-experts", "8"]
    assert moe_layer(parse_args([*flags, "--seed", "7"])).init_seed == 7
    assert (
        moe_layer(parse_args(flags)).init_seed
        == 1234
        == MoELayerConfig(num_experts=8, hidden_size=8, ffn_hidden_size=8).init_seed
    )


def test_weights_do_not_depend_on_the_generators_state_and_leave_it_alone():
    torch.manual_seed(1)
    a = experts()
    after_a = torch.rand(3)  # the host generator continues as if nothing had been drawn
    torch.manual_seed(1)
    expected_after = torch.rand(3)
    torch.manual_seed(2)
    with device_generator_apart():  # and whatever the tracker points at
        b = experts()
    assert torch.equal(after_a, expected_after)
    assert torch.equal(a.weight1, b.weight1) and torch.equal(a.weight2, b.weight2)


def test_experts_layers_and_seeds_all_differ():
    base = experts()
    w1 = base.weight1.detach()
    assert all(not torch.equal(w1[i], w1[j]) for i in range(4) for j in range(i + 1, 4))
    assert not torch.equal(experts(layer_number=2).weight1, base.weight1)
    assert not torch.equal(experts(init_seed=99).weight1, base.weight1)


def test_keyed_seed_depends_on_every_key():
    seeds = {keyed_seed(s, layer, e) for s in (0, 1) for layer in (0, 1, 2) for e in range(8)}
    assert len(seeds) == 2 * 3 * 8 and all(0 <= s < 2**63 for s in seeds)
    with host_rng_keyed(5, 1, 2):
        first = torch.randn(4)
    with host_rng_keyed(5, 1, 2):
        assert torch.equal(torch.randn(4), first)


class FakeGroup:
    """A process group as FFNExperts sees it: its size and this process's rank in it."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def _as_on_a_gpu(device: str):
    """The tracker's streams in a generator the host-side init does not read: CUDA's own on a GPU, else the
    stand-in."""
    return contextlib.nullcontext() if device == "cuda" else device_generator_apart()


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")])],
)
def test_ep_and_esp_ranks_under_the_trackers_fork_hold_their_own_slices(device, monkeypatch):
    """As `MoELayer` once built them, under megatron-core's expert-parallel fork (each EP rank its own stream),
    with the tracker as on a GPU: rank (EP r, ESP p)'s weights are experts r*L..(r+1)*L-1's slice p of the
    whole layer built in one process, and EP ranks hold different experts. On the old init every EP rank drew
    the same numbers there (the fork swapped a generator the init did not read)."""
    monkeypatch.setattr(comm, "group_size", lambda g: 1 if g is None else g.size)
    monkeypatch.setattr(comm, "group_rank", lambda g: 0 if g is None else g.rank)
    whole = experts()  # 4 experts, F = 24: all of them, whole
    local, esp = 2, 2
    with _as_on_a_gpu(device):
        tracker, name = CudaRNGStatesTracker(), expert_parallel_stream()  # megatron-core's, not the process's
        for ep_rank in range(2):
            for esp_rank in range(esp):
                tracker.reset()
                tracker.add(name, 1234 + 100 * ep_rank + esp_rank)  # megatron's per-rank expert seeds
                torch.manual_seed(1234)  # the host generator alike on every rank of a stage
                with tracker.fork(name):
                    part = FFNExperts(
                        **{**SIZES, "num_local_experts": local},
                        init_method=functools.partial(torch.nn.init.normal_, std=0.02),
                        output_init_method=functools.partial(torch.nn.init.normal_, std=0.02),
                        ep_group=FakeGroup(ep_rank, 2),
                        esp_group=FakeGroup(esp_rank, esp),
                        init_seed=1234,
                        layer_number=1,
                    ).to(device)
                experts_ = slice(ep_rank * local, (ep_rank + 1) * local)
                f = slice(esp_rank * 12, (esp_rank + 1) * 12)
                gate, up = whole.weight1[experts_].chunk(2, dim=1)
                assert torch.equal(part.weight1.cpu(), torch.cat([gate[:, f], up[:, f]], dim=1)), (ep_rank, esp_rank)
                assert torch.equal(part.weight2.cpu(), whole.weight2[experts_, :, f]), (ep_rank, esp_rank)
    assert not torch.equal(whole.weight1[:local], whole.weight1[local:])
