"""Muon: the emerging_optimizers stand-in (platform/emerging_optimizers.py, v0.1.0's code) against an SVD and a
hand-written step, and --optimizer muon's flag pass (tests/distributed/train_worker.py trains it)."""

import pytest
import torch

from megatron_moe.config import ConfigError, parse_and_validate
from megatron_moe.config.groups_optimizer import MUON_COEFFICIENT_SET_LENGTHS
from megatron_moe.platform import emerging_optimizers as eo

QUINTIC_BAND = (0.68, 1.13)
"""Where quintic's 5 steps leave the singular values of a normalized matrix (Keller Jordan's coefficients trade
exactness for speed: about U S' V^T, S' noisy in [0.68, 1.13] rather than the identity)."""


def test_the_coefficient_sets_the_flags_offer_are_the_stand_ins():
    assert {k: eo.coefficient_set_length(k) for k in eo.COEFFICIENT_TYPES} == MUON_COEFFICIENT_SET_LENGTHS


@pytest.mark.parametrize("shape", [(32, 48), (48, 32)])
def test_quintic_newton_schulz_orthogonalizes(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    with eo.fp32_matmul_precision("highest"):
        y = eo.newton_schulz(x, steps=5, coefficient_type="quintic")
    s = torch.linalg.svdvals(y)
    assert QUINTIC_BAND[0] < s.min() and s.max() < QUINTIC_BAND[1], s
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    polar = u @ vh  # the exact orthogonalization; y is it with singular values within the band
    assert (y - polar).norm() / polar.norm() < 0.3
    # y and U V^T share their singular vectors: y = U diag(s') V^T
    assert torch.allclose(u.mT @ y @ vh.mT, torch.diag(torch.diagonal(u.mT @ y @ vh.mT)), atol=2e-3)


def test_polar_express_gets_closer_to_u_vt():
    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(1))
    with eo.fp32_matmul_precision("highest"):
        y = eo.newton_schulz(x, steps=8, coefficient_type="polar_express")
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    assert torch.allclose(y, u @ vh, atol=0.05)


def test_medium_precision_runs_the_iteration_in_bfloat16():
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(2))
    with eo.fp32_matmul_precision("medium"):
        medium = eo.newton_schulz(x, steps=5)
    with eo.fp32_matmul_precision("highest"):
        full = eo.newton_schulz(x, steps=5)
    assert medium.dtype == torch.float32 and not torch.equal(medium, full)
    assert torch.allclose(medium, full, atol=0.05)


def test_steps_must_be_a_multiple_of_the_set():
    with pytest.raises(ValueError, match="multiple"):
        eo.newton_schulz(torch.randn(4, 4), steps=3, coefficient_type="quintic")


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("spectral", 64**0.5), ("shape_scaling", (64 / 16) ** 0.5), ("unit_rms_norm", (64 / 16) ** 0.5)],
)
def test_scale_modes(mode, expected):
    assert eo.get_muon_scale_factor(64, 16, mode=mode) == pytest.approx(expected)
    assert eo.get_muon_scale_factor(16, 64, mode="shape_scaling") == 1.0
    assert eo.get_muon_scale_factor(16, 64, mode="unit_rms_norm") == pytest.approx(0.5)


@pytest.mark.parametrize(("nesterov", "method"), [(False, "decoupled"), (True, "decoupled"), (True, "l2")])
def test_one_step_is_the_formula(nesterov, method):
    """Two steps of the optimizer against the same formula written out: EMA momentum (Nesterov optional), weight
    decay (decoupled: on the weight times lr; l2: on the gradient), the orthogonalized update times its scale."""
    lr, beta, wd, shape = 0.02, 0.9, 0.1, (12, 20)
    gen = torch.Generator().manual_seed(3)
    w0, grads = torch.randn(*shape, generator=gen), [torch.randn(*shape, generator=gen) for _ in range(2)]

    def ortho(g):
        return eo.newton_schulz(g, steps=5) * eo.get_muon_scale_factor(*shape)

    p = torch.nn.Parameter(w0.clone())
    opt = eo.OrthogonalizedOptimizer(
        [p], lr, beta, wd, use_nesterov=nesterov, weight_decay_method=method, fp32_matmul_prec="highest",
        scaled_orthogonalize_fn=ortho,
    )  # fmt: skip
    w, m = w0.clone(), torch.zeros(shape)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        g = g.clone()
        if method == "decoupled":
            w = w - lr * wd * w
        else:
            g = g + wd * w
        m = beta * m + (1 - beta) * g
        update = (1 - beta) * g + beta * m if nesterov else m
        with eo.fp32_matmul_precision("highest"):
            w = w - lr * ortho(update)
    assert torch.allclose(p.detach(), w, atol=1e-6)


MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 "
    "--expert-model-parallel-size 2"
).split()


def test_muon_flags_reach_the_config():
    cfg = parse_and_validate([*MODEL, "--optimizer", "muon", "--muon-momentum", "0.8", "--muon-nesterov"], 2)
    t = cfg.training
    assert (t.optimizer, t.muon_momentum, t.muon_nesterov, t.muon_tp_mode) == ("muon", 0.8, True, "duplicated")
    assert cfg.optimizer_kind == "muon" and not cfg.sharded_by_ddp
    layer_wise = parse_and_validate([*MODEL, "--optimizer", "muon", "--use-distributed-optimizer", "--bf16"], 2)
    assert layer_wise.optimizer_kind == "layer_wise_muon" and not layer_wise.sharded_by_ddp
    assert parse_and_validate([*MODEL, "--optimizer", "dist_muon", "--bf16"], 2).optimizer_kind == "layer_wise_muon"
    renamed = parse_and_validate([*MODEL, "--optimizer", "muon", "--muon-use-nesterov"], 2)
    assert renamed.training.muon_nesterov


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--fp16"], "--fp16"),
        (["--use-megatron-fsdp"], "--use-megatron-fsdp"),
        (["--use-torch-fsdp2"], "--use-torch-fsdp2"),
        (["--ckpt-format", "torch"], "--ckpt-format=torch"),
        (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format=fsdp_dtensor"),
        (["--muon-num-ns-steps", "4"], "--muon-num-ns-steps=4"),
        (["--muon-fp32-matmul-prec", "low"], "--muon-fp32-matmul-prec=low"),
        (["--muon-scalar-optimizer", "lion"], "--muon-scalar-optimizer=lion"),
        (["--use-distributed-optimizer"], "--bf16=False"),
        (["--use-distributed-optimizer", "--bf16", "--overlap-param-gather", "--overlap-grad-reduce"],
         "--overlap-param-gather"),
    ],
)  # fmt: skip
def test_what_muon_cannot_run_with_is_refused_by_name(extra, flag):
    with pytest.raises(ConfigError, match=flag.replace("[", r"\[")):
        parse_and_validate([*MODEL, "--optimizer", "muon", *extra], 2)


@pytest.mark.parametrize("name", ["sgd", "lion", "soap", "adaptive_muon"])
def test_other_optimizers_are_refused_by_name(name):
    with pytest.raises(ConfigError, match=f"--optimizer={name}: optimizers other than Adam and Muon"):
        parse_and_validate([*MODEL, "--optimizer", name], 2)


def test_torch_dist_and_the_legacy_layout_flag_pass():
    cfg = parse_and_validate(
        [*MODEL, "--optimizer", "muon", "--ckpt-format", "torch_dist", "--no-use-layer-wise-param-layout"], 2
    )
    assert any("--no-use-layer-wise-param-layout" in note for note in cfg.notes)
