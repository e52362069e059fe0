"""Selective activation policy: exact gradients with recompute, bounded error with quantize,
fewer saved bytes, and clear errors for bad policies."""

import pytest
import torch

from megatron_moe.activations.apply import apply_activation_policy
from megatron_moe.activations.engine import SavedBytes
from megatron_moe.activations.quantize import dequantize, dequantize_rows, quantize
from megatron_moe.config import ConfigError, parse_args
from megatron_moe.config.activation_policy import MODULES, build_policy
from megatron_moe.config.activation_policy import QUANT_FORMATS as FORMATS

VOCAB = 512
MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--num-experts", "4", "--moe-layer-freq", "2", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
    "--data-path", "x", "--tokenizer-model", "x",
    "--no-gradient-accumulation-fusion",  # built without DDP: no main_grad for a fused GEMM to accumulate into
]  # fmt: skip


def run(policy_flags, counter=None):
    """Loss and gradients of one forward/backward from fixed weights, inputs and RNG."""
    from megatron_moe.model import build_model, transformer_config
    from megatron_moe.platform.rng import seed_model_parallel

    cfg = parse_args([*MODEL, *policy_flags])
    cfg.validate(world_size=1)
    torch.manual_seed(0)
    seed_model_parallel(0)
    model = build_model(cfg, transformer_config(cfg), VOCAB)
    if counter is not None:
        apply_activation_policy(
            model,
            cfg.activation_policy() or build_policy(preset="none", recompute=[], quantize=[], quant_format="int8_row"),
            counter,
        )
    g = torch.Generator().manual_seed(1)
    device = next(model.parameters()).device  # the GPU where there is one
    tokens = torch.randint(0, VOCAB, (4, 64), generator=g).to(device)
    positions = torch.arange(64, device=device).expand(4, 64)
    torch.manual_seed(5)  # dropout masks drawn from here on
    loss = model(tokens, positions, None, labels=tokens).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_recompute_gives_identical_gradients(megatron_world1):
    recompute = [n for n in MODULES if n not in ("dispatch", "combine")]
    loss0, grads0 = run([])
    loss1, grads1 = run(["--recompute-modules", *recompute])
    assert loss1 == loss0
    assert grads1.keys() == grads0.keys()
    for name in grads0:
        assert torch.equal(grads1[name], grads0[name]), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_arctic_quantized_gradients_close_and_fewer_bytes(megatron_world1, fmt):
    none_bytes, arctic_bytes = SavedBytes(), SavedBytes()
    loss0, grads0 = run([], none_bytes)
    loss1, grads1 = run(["--activation-policy", "arctic", "--activation-quant-format", fmt], arctic_bytes)
    assert loss1 == loss0  # quantization only touches what backward reads
    total0 = torch.cat([g.flatten() for g in grads0.values()])
    total1 = torch.cat([grads1[n].flatten() for n in grads0])
    rel = ((total1 - total0).norm() / total0.norm()).item()
    assert rel < (0.05 if fmt == "fp8_row" else 0.02), rel
    assert arctic_bytes.bytes < 0.6 * none_bytes.bytes, (arctic_bytes.bytes, none_bytes.bytes)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_round_trip(fmt):
    """int8: each element within half a step of its group's scale (its group's largest magnitude / 127), the group
    a row, or a block of 64 of the flattened tensor (before: within 1% of its row's largest, which a block
    straddling into a larger row can exceed: 1.03% after another selection of tests drew other numbers)."""
    x = torch.randn(300, 70, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.01, 10, 70)
    p = quantize(x, fmt, block=64)
    y = dequantize(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert p.nbytes < x.nbytes / 3
    error, row_max = (y - x).abs(), x.abs().amax(dim=-1, keepdim=True)
    if fmt == "fp8_row":
        assert (error / row_max).max() < 0.07
    else:
        if fmt == "int8_block":
            blocks = torch.nn.functional.pad(x.abs().flatten(), (0, -x.numel() % 64)).view(-1, 64).amax(dim=1)
            group_max = blocks.repeat_interleave(64)[: x.numel()].view_as(x)
        else:
            group_max = row_max.expand_as(x)
        assert (error <= group_max / 254 * (1 + 1e-4)).all(), (error / group_max).max()
    for start, end in ((0, 300), (5, 9), (299, 300)):  # int8_block: groups of 64 straddle the rows of 70
        assert torch.equal(dequantize_rows(p, start, end), y[start:end])


def test_views_of_one_block_share_one_packed_copy_and_unpack_exactly_as_the_view():
    """Attention's q and k as permuted views of one [s, b, np, hn] block: one copy in storage order, no
    transposing copy; each unpacks to its own view. So are rows with equal gaps (v of a fused QKV); an
    irregular view is packed as a copy; narrow rows not at all."""
    from megatron_moe.activations.engine import LayerScope, Use
    from megatron_moe.activations.quantize import dequantize
    from megatron_moe.config.activation_policy import build_policy

    scope = LayerScope(build_policy(preset="none", recompute=[], quantize=["core_attention"], quant_format="int8_row"))
    block = torch.randn(256, 2, 4, 64, generator=torch.Generator().manual_seed(0))  # [s, b, np, hn]
    q = block.reshape(256, 8, 64).transpose(0, 1)  # [b*np, s, hn]
    k = q.transpose(1, 2)  # [b*np, hn, s]: its last dim is not the stride-1 dim
    stored_q, stored_k = scope._quantized_use(q), scope._quantized_use(k)
    assert isinstance(stored_q, Use) and stored_q.shared is stored_k.shared
    assert stored_q.shared.packed.data.shape == (256 * 2 * 4, 64)  # rows along hn, in storage order
    exact = dequantize(stored_q.shared.packed).view(block.shape)  # what the int8 copy holds, as the block
    for stored, view in ((stored_q, q), (stored_k, k)):
        unpacked = scope._unpack(stored)
        assert unpacked.shape == view.shape
        torch.testing.assert_close(unpacked, view, atol=0.03, rtol=0)  # int8 per row of 64
    torch.testing.assert_close(scope._unpack(scope._quantized_use(k)), exact.reshape(256, 8, 64).permute(1, 2, 0))
    gapped = block[..., 16:].transpose(0, 1)  # like v of a fused QKV: a gap before every row, permuted
    stored = scope._quantized_use(gapped)
    assert stored.shared.in_storage_order and stored.shared.packed.data.shape == (256 * 2 * 4, 48)
    torch.testing.assert_close(scope._unpack(stored), gapped, atol=0.03, rtol=0)
    from megatron_moe.activations.quantize import quantize

    copied = dequantize(quantize(block[..., 16:].reshape(-1, 48), "int8_row")).view(256, 2, 4, 48)
    assert torch.equal(scope._unpack(scope._quantized_use(gapped)), copied.transpose(0, 1))  # same rows, same scales
    irregular = block[::3]  # rows of 64, but the row spacing is not one stride: packed as a copy of its elements
    stored = scope._quantized_use(irregular)
    assert not stored.shared.in_storage_order
    torch.testing.assert_close(scope._unpack(stored), irregular, atol=0.03, rtol=0)
    narrow = block[..., :16].contiguous()  # rows of 16: the scales would cost 1/4 of the int8 bytes
    assert scope._quantized_use(narrow) is narrow


def test_unknown_module_name():
    with pytest.raises(ConfigError, match=r"--recompute-modules=attention: a module name, one of: input_norm"):
        parse_args([*MODEL, "--recompute-modules", "attention"]).validate(1)


def test_recompute_and_quantize_together():
    policy = parse_args(
        [*MODEL, "--recompute-modules", "mlp_act", "--quantize-activations", "mlp_act"]
    ).activation_policy()
    assert policy.mode("mlp_act") == "recompute+quantize"


def test_quantizing_a_module_with_nothing_to_quantize():
    with pytest.raises(ConfigError, match=r"--quantize-activations=dispatch: the dispatch all-to-all keeps no"):
        parse_args([*MODEL, "--quantize-activations", "dispatch"]).validate(1)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--recompute-granularity", "full", "--activation-policy", "arctic"], "full recompute conflicts with"),
        (["--recompute-granularity", "selective"], "name what to recompute or quantize"),
    ],
)
def test_conflicting_policies(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args([*MODEL, *flags]).validate(1)
