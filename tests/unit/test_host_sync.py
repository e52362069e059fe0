"""The host-sync counter (platform/host_sync.py) and the MoE layer's one wait for the device.

On the host the counter records the calls that would make the host wait on an
accelerator; each case below is one such call (or one that must not count).
The EP=2 count of the layer is in tests/distributed/test_moe_layer.py.
"""

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megatron_moe.moe import MoELayer, MoELayerConfig
from megatron_moe.platform import count_host_syncs, to_host

CPU = torch.device("cpu")
t = torch.tensor([3, 0, 2])
mask = t > 1

WAITS = {
    "item": lambda: t[0].item(),
    "tolist": lambda: t.tolist(),
    "bool": lambda: bool(mask.any()),
    "if": lambda: 1 if t.sum() else 0,
    "int": lambda: int(t.sum()),
    "float": lambda: float(t.sum()),
    "index": lambda: [1, 2, 3][t[2]],
    "format": lambda: f"{t.sum():d}",
    "numpy": lambda: t.numpy(),
    "cpu": lambda: t.cpu(),
    "to_cpu": lambda: t.to("cpu"),
    "nonzero": lambda: t.nonzero(),
    "masked_select": lambda: t.masked_select(mask),
    "unique": lambda: torch.unique(t),
    "bincount": lambda: torch.bincount(t),
    "where_one_arg": lambda: torch.where(mask),
    "mask_index": lambda: t[mask],
    "mask_assign": lambda: t.clone().__setitem__(mask, 0),
    "repeat_interleave_tensor_repeats": lambda: torch.repeat_interleave(t, t),
    "equal": lambda: torch.equal(t, t),
    "allclose": lambda: torch.allclose(t.float(), t.float()),
}
NO_WAITS = {
    "index_select": lambda: t.index_select(0, torch.tensor([0, 2])),
    "cat_cumsum_sort": lambda: torch.sort(torch.cumsum(torch.cat([t, t]), 0)),
    "repeat_interleave_output_size": lambda: torch.repeat_interleave(t, t, output_size=5),
    "repeat_interleave_int": lambda: t.repeat_interleave(2),
    "nonzero_static": lambda: torch.nonzero_static(t, size=2),
    "where_three_args": lambda: torch.where(mask, t, 0),
    "to_dtype": lambda: t.to(torch.float32),
    "from_host": lambda: torch.tensor([1, 2]),
    "shape": lambda: t.shape[0] + t.numel(),
}


@pytest.mark.parametrize("name", sorted(WAITS))
def test_counter_sees_each_kind_of_device_read(name):
    with count_host_syncs(CPU) as syncs:
        WAITS[name]()
    assert syncs.count == 1, syncs.events


@pytest.mark.parametrize("name", sorted(NO_WAITS))
def test_counter_ignores_work_that_stays_on_the_device(name):
    with count_host_syncs(CPU) as syncs:
        NO_WAITS[name]()
    assert syncs.count == 0, syncs.events


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * (2 if grad.sum().item() != 0 else 0)


def test_counter_sees_a_read_in_a_custom_backward_and_stops_at_the_end_of_the_block():
    x = torch.ones(3, requires_grad=True)
    with count_host_syncs(CPU) as syncs:
        _ReadsInBackward.apply(x).sum().backward()
    x.sum().item()  # outside the block
    assert syncs.events == ["_local_scalar_dense"]  # what item() runs


def test_to_host_reads_several_tensors_in_one_copy():
    a, b = torch.tensor([[1, 2], [3, 4]]), torch.tensor([7], dtype=torch.int32)
    with count_host_syncs(CPU) as syncs:
        values = to_host(a, None, b)
        nothing = to_host(None)
    assert values == [[1, 2, 3, 4], None, [7]] and nothing == [None]
    assert syncs.count == 1


H, E = 16, 4


def _layer(**fields) -> MoELayer:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        ffn_hidden_size=24,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_router_topk=2,
        add_bias_linear=False,
    )
    torch.manual_seed(0)
    sizes = dict(num_experts=E, hidden_size=H, ffn_hidden_size=24, topk=2, aux_loss_coeff=0.0)
    return MoELayer(config, MoELayerConfig(**{**sizes, **fields}), layer_number=1)


def _syncs_of_one_step(layer: MoELayer) -> list[str]:
    x = torch.randn(12, 2, H, requires_grad=True)
    out, _ = layer(x)  # warm-up: kernel probes run once per process and GEMM shape (the input's gradient's too)
    out.sum().backward()
    with count_host_syncs(CPU) as syncs:
        out, _ = layer(x)
        out.sum().backward()
    return syncs.events


LAYOUTS = {
    "dropless_exact": dict(),
    "capacity_exact_drops": dict(capacity_factor=0.5),
    "adaptive_exact": dict(capacity_factor=-0.5),
    "dropless_padded": dict(pad_expert_input_to_capacity=True),
    "capacity_padded_drops": dict(capacity_factor=0.5, pad_expert_input_to_capacity=True),
    "dense_ordering": dict(ordering="dense", capacity_factor=0.5),
    "expert_choice": dict(gate="expert_choice"),
    "bpr_drops": dict(gate="bpr", capacity_factor=0.5),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_moe_layer_waits_for_the_device_once_per_forward_and_backward(name):
    assert _syncs_of_one_step(_layer(**LAYOUTS[name])) == ["tolist"]  # to_host's one copy in MoELayer.arrange


def test_soft_gate_layer_reads_nothing_on_one_rank():
    assert _syncs_of_one_step(_layer(gate="soft", soft_slots=2)) == []


def test_counter_catches_an_extra_read_in_the_layer():
    layer = _layer(capacity_factor=0.5)
    arrange = layer.arrange

    def arrange_and_peek(routing):
        arranged = arrange(routing)
        arranged[0].routed_E.tolist()  # a second wait, as a careless change would add
        return arranged

    layer.arrange = arrange_and_peek
    assert _syncs_of_one_step(layer) == ["tolist", "tolist"]
