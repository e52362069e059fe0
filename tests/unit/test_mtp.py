"""Multi-token prediction (--mtp-num-layers, --mtp-loss-scaling-factor): the flag pass, the model (its MTP layer's
MoE is our layer, numbered after --num-layers), and one-rank training: the MTP loss is reported beside the lm loss,
which stays the main token's; with the factor 0 the main weights train exactly as without MTP."""

from __future__ import annotations

import pytest
import torch

from megatron_moe.config import ConfigError, parse_args
from tests.unit.one_rank_run import MICRO, SEQ, VOCAB, one_rank_trainer

BASE = ["--data-path", "d", "--tokenizer-model", "t"]


def validated(*flags: str):
    cfg = parse_args([*BASE, "--num-experts", "4", *flags])
    cfg.validate(world_size=1)
    return cfg


def test_defaults_are_megatron_lms():
    from megatron.core.transformer import TransformerConfig

    cfg = validated()
    defaults = TransformerConfig.__dataclass_fields__
    assert cfg.model.mtp_num_layers is defaults["mtp_num_layers"].default is None
    assert cfg.model.mtp_loss_scaling_factor == defaults["mtp_loss_scaling_factor"].default == 0.1
    assert validated("--mtp-num-layers", "2").model.layer_count == 4 + 2


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--mtp-num-layers", "-1"], "--mtp-num-layers=-1: must be >= 0"),
        (["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "-0.5"], "--mtp-loss-scaling-factor=-0.5"),
        (["--mtp-num-layers", "1", "--position-embedding-type", "learned_absolute"], "rope with --mtp-num-layers=1"),
    ],
)
def test_the_flag_pass_refuses_by_name(flags, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        validated(*flags)


def test_zero_layers_is_no_mtp():
    cfg = validated("--mtp-num-layers", "0", "--position-embedding-type", "learned_absolute")
    assert cfg.model.mtp_layers == 0 and cfg.moe.moe_layer_count(cfg.model) == 4


class FixedBatches:
    """The same few batches over and over (their own generator: the model's build draws from torch's), so a run
    can fit them and two runs see the same tokens."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.batches = [torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(2)]
        self.train_iterator = self.valid_iterator()

    def valid_iterator(self):
        def batches():
            while True:
                for tokens in self.batches:
                    yield {
                        "tokens": tokens,
                        "labels": torch.roll(tokens, -1, dims=1),
                        "loss_mask": torch.ones(MICRO, SEQ),
                        "position_ids": torch.arange(SEQ).expand(MICRO, SEQ),
                    }

        return batches()


def trained(*flags: str, steps: int = 4) -> tuple[list[dict], object]:
    torch.manual_seed(0)
    _, trainer = one_rank_trainer("--train-iters", str(steps), "--lr", "1e-3", *flags)
    trainer.data = FixedBatches()
    trainer.data.train_iterator = trainer.data.valid_iterator()
    return [trainer.train_step() for _ in range(steps)], trainer


def test_the_mtp_layers_moe_is_ours_numbered_after_the_decoder(megatron_world1):
    from megatron.core.utils import unwrap_model

    from megatron_moe.moe.layer import MoELayer

    _, trainer = trained("--mtp-num-layers", "1", steps=0)
    model = unwrap_model(trainer.model[0])
    layer = model.mtp.layers[0].transformer_layer
    assert isinstance(layer.mlp, MoELayer)
    assert layer.layer_number == layer.mlp.layer_number == 3  # --num-layers 2, then MTP
    assert trainer.num_moe_layers == 3


def test_mtp_trains_reports_its_loss_and_the_lm_loss_stays_the_main_tokens(megatron_world1):
    plain, _ = trained()
    mtp, _ = trained("--mtp-num-layers", "1")
    lm = [s["lm loss"] for s in mtp]
    losses = [s["aux"]["mtp_1 loss"] for s in mtp]
    assert all(torch.isfinite(torch.tensor(lm + losses)))
    assert lm[-1] < lm[0] and losses[-1] < losses[0]
    assert "mtp_1 loss" not in plain[0]["aux"]
    # The first step's forward runs on the same main weights: the lm loss is the main token's alone.
    assert lm[0] == plain[0]["lm loss"]
    # Afterwards the MTP loss's gradient reaches the shared weights (embedding, decoder): a different trajectory.
    assert lm[1:] != [s["lm loss"] for s in plain[1:]]


def test_factor_zero_trains_the_main_weights_exactly_as_without_mtp(megatron_world1):
    """The factor weighs the MTP token losses only: the MTP layer's own router loss still reaches the decoder, as
    in megatron-core, so the invariant holds without it (and differs with it: the test below)."""
    # No clipping either: the grad norm over more tensors (the MTP layer's zeros) rounds differently (~1e-8).
    no_router_loss = ("--moe-aux-loss-coeff", "0", "--clip-grad", "0")
    plain, _ = trained(*no_router_loss)
    zero, _ = trained("--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0", *no_router_loss)
    assert [s["lm loss"] for s in zero] == [s["lm loss"] for s in plain]
    assert [s["grad_norm"] for s in zero] == pytest.approx([s["grad_norm"] for s in plain], rel=1e-6)
    assert all(s["aux"]["mtp_1 loss"] > 0 for s in zero)  # still computed and reported
    balanced, _ = trained("--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0")
    assert [s["lm loss"] for s in balanced][1:] != [s["lm loss"] for s in trained()[0]][1:]


BIAS = ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]


@pytest.mark.parametrize(
    "flags",
    [["--activation-policy", "arctic"], ["--moe-layer-impl", "mcore"], ["--recompute-granularity", "full"], BIAS],
    ids=["arctic_policy", "mcore_layer", "full_recompute", "expert_bias"],
)
def test_mtp_composes(megatron_world1, flags):
    """The activation policy reaches the MTP layer; megatron-core's own MoE layer in it has its aux-loss slot
    (its tracker is sized num_layers + MTP layers); megatron-core's full recompute checkpoints the MTP layer; the
    MTP layer's expert bias moves after each step as the decoder's."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.core.utils import unwrap_model

    steps, trainer = trained("--mtp-num-layers", "1", *flags, steps=2)
    assert torch.isfinite(torch.tensor([[s["lm loss"], s["aux"]["mtp_1 loss"]] for s in steps])).all()
    assert steps[0]["aux"]["moe aux loss"] > 0
    layer = unwrap_model(trainer.model[0]).mtp.layers[0].transformer_layer
    assert isinstance(layer, TransformerLayer)
    if flags is BIAS:
        assert layer.mlp.gate.expert_bias.abs().sum() > 0
    if "arctic" in flags:
        assert "forward" in vars(layer)  # wrapped in the policy's scope, as the decoder's layers


def test_an_earlier_shallower_model_in_the_process_leaves_no_tracker_slots_behind(megatron_world1):
    """megatron-core sizes its process-wide aux-loss and MTP trackers by the first model that records into them: a
    one-slot entry left by an earlier model made this deeper one's layer 2 index past the end (CI, test order)."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"] = {"values": torch.zeros(1)}
    MTPLossLoggingHelper.tracker["values"] = torch.zeros(1)
    steps, _ = trained("--mtp-num-layers", "2", "--moe-layer-impl", "mcore", steps=1)
    assert steps[0]["aux"]["moe aux loss"] > 0 and {"mtp_1 loss", "mtp_2 loss"} <= set(steps[0]["aux"])


def test_the_log_line_and_tensorboard_show_the_mtp_losses():
    from megatron_moe.training.log_line import short_line
    from megatron_moe.training.tensorboard_tags import tag_of

    record = {"iteration": 5, "train_iters": 10, "lm loss": 6.5, "mtp_1 loss": 6.75, "mtp_2 loss": 7.0}
    record |= {"ms_per_iteration": 100.0, "tokens_per_s": 1000.0, "eta_s": 1.0}
    assert "| lm loss: 6.5000 | mtp_1 loss: 6.7500 | mtp_2 loss: 7.0000 |" in short_line(record)
    assert tag_of("mtp_1 loss") == "loss/mtp_1 loss"


def test_export_to_mixtral_names_the_mtp_layers():
    from megatron_moe.checkpointing import hf_families

    cfg = validated("--mtp-num-layers", "1", "--swiglu", "--normalization", "RMSNorm")
    assert any(p.startswith("--mtp-num-layers=1: Mixtral has no") for p in hf_families.incompatibilities(cfg))


def test_model_flops_count_the_mtp_layers():
    """Each MTP layer: its projection (2h x h), a layer of the last layer's kind and the output layer again."""
    from megatron_moe.training.flops import flops_per_token, matmul_params_per_token

    plain, mtp = validated("--num-layers", "1"), validated("--num-layers", "1", "--mtp-num-layers", "1")
    h, vocab = plain.model.hidden_size, 1000
    one_layer = matmul_params_per_token(plain, vocab) - h * vocab
    assert matmul_params_per_token(mtp, vocab) == 2 * one_layer + 2 * h * h + 2 * h * vocab
    assert (
        flops_per_token(mtp, vocab) - flops_per_token(plain, vocab)
        == 6 * (one_layer + 2 * h * h + h * vocab) + 12 * plain.model.seq_length * h
    )
