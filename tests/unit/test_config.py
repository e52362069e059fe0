"""Flag parsing, the one MoE configuration, and the errors for bad flags, layouts and batch sizes."""

import dataclasses
import os
import re

import pytest

from megatron_moe.config import ConfigError, MoELayerConfig, RunConfig, build_parser, parse_args
from megatron_moe.config.fields import flag_name
from tests.conftest import ROOT

BASE = ["--data-path", "d", "--tokenizer-model", "t.model", "--num-experts", "8"]


def cfg(*flags):
    return parse_args([*BASE, *flags])


def parser_flags_by_group() -> dict[str, set[str]]:
    """{group title: its flags} as --help lists them (each flag's first spelling, so no --no-X)."""
    groups = build_parser()._action_groups[2:]  # after argparse's own positionals/options groups
    return {g.title: {a.option_strings[0] for a in g._group_actions} for g in groups}


def docs_flags_by_group() -> dict[str, set[str]]:
    """{group: flags} from the group table of docs/flags.md (the README's former "## Flags" section)."""
    with open(os.path.join(ROOT, "docs", "flags.md"), encoding="utf-8") as f:
        page = f.read()
    rows = [line.split("|") for line in page.splitlines() if re.match(r"\| `\w+` \|", line)]
    return {row[1].strip(" `"): set(re.findall(r"`(--[\w-]+)`", row[3])) for row in rows}


def test_docs_flag_table_matches_help_both_ways():
    docs, parser = docs_flags_by_group(), parser_flags_by_group()
    assert set(docs) == set(parser)
    for group in parser:
        assert docs[group] - parser[group] == set(), f"docs/flags.md lists flags that --help does not have ({group})"
        assert parser[group] - docs[group] == set(), f"--help has flags docs/flags.md does not list ({group})"


def test_defaults_fill_global_batch():
    c = cfg("--micro-batch-size", "2")
    c.validate(world_size=4)
    assert c.training.global_batch_size == 8 and c.num_microbatches(4) == 1


def test_moe_layer_freq():
    assert cfg("--moe-layer-freq", "2").moe.layer_pattern(4) == [1, 0, 1, 0]
    assert cfg("--moe-layer-freq", "[0,1,1,0]").moe.layer_pattern(4) == [0, 1, 1, 0]
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        cfg("--moe-layer-freq", "[1,0]").moe.layer_pattern(4)
    # Megatron-LM's list expressions (moe_freq_type), evaluated on the syntax tree
    assert cfg("--moe-layer-freq", "([0]+[1]*2)").moe.layer_pattern(3) == [0, 1, 1]
    assert cfg("--moe-layer-freq", "([0]*3+[1]*58)").moe.layer_pattern(61) == [0] * 3 + [1] * 58
    assert cfg("--moe-layer-freq", "([1]*3+[0]*2)*2").moe.layer_pattern(10) == [1, 1, 1, 0, 0] * 2
    assert cfg("--moe-layer-freq", "[0, 1, 1]").moe.layer_pattern(3) == [0, 1, 1]
    bad = [
        ("([0]+[1]*2)", 4, r"--moe-layer-freq=\(\[0\]\+\[1\]\*2\): a list .* of 4 zeros and ones \(--num-layers\)"),
        ("[0,2,1]", 3, "zeros and ones"),
        ("[__import__('os')]", 1, "zeros and ones"),
        ("[1]*10**9", 1, "zeros and ones"),
        ("[1.0]", 1, "zeros and ones"),
        ("x", 1, "a positive integer"),
    ]
    for text, layers, message in bad:
        with pytest.raises(ConfigError, match=message):
            cfg("--moe-layer-freq", text).moe.layer_pattern(layers)


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (
            ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
            6,
            r"world size=6: must be a multiple of TP x PP x CP = 2 x 2 x 1 = 4",
        ),
        (
            ["--expert-model-parallel-size", "3"],
            3,
            r"--num-experts=8: must be a multiple of --expert-model-parallel-size=3",
        ),
        (
            ["--tensor-model-parallel-size", "2"],
            2,
            r"--sequence-parallel=False: MoE with --tensor-model-parallel-size=2 needs --sequence-parallel",
        ),
        (
            ["--micro-batch-size", "4", "--global-batch-size", "10"],
            2,
            r"--global-batch-size=10: must be a multiple of --micro-batch-size x data-parallel size = 4 x 2 = 8",
        ),
        (["--moe-router-topk", "9"], 1, r"--moe-router-topk=9: must be between 1 and --num-experts=8"),
        (["--num-attention-heads", "3"], 1, r"--hidden-size=256: must be a multiple of --num-attention-heads=3"),
        (["--bf16", "--fp16"], 1, r"--bf16/--fp16=both: choose one"),
        (["--pipeline-model-parallel-size", "3"], 3, r"--pipeline-model-parallel-size=3: must divide --num-layers=4"),
        (["--expert-model-parallel-size", "4"], 2, r"--expert-model-parallel-size=4: EP x expert-TP = 4 must divide"),
        (
            ["--expert-tensor-parallel-size", "3", "--moe-ffn-hidden-size", "128"],
            3,
            r"--expert-tensor-parallel-size=3: must divide the experts' width --moe-ffn-hidden-size=128 .* e.g. 2",
        ),
        (
            ["--expert-tensor-parallel-size", "2", "--moe-layer-impl", "mcore"],
            2,
            r"--expert-tensor-parallel-size=2: megatron-core's layer .* expert biases only at 1 .* "
            r"--expert-tensor-parallel-size 1 or --disable-bias-linear",
        ),
        (  # unset: TP (Megatron-LM's default), so the same refusal names it
            ["--tensor-model-parallel-size", "2", "--moe-layer-impl", "mcore"],
            2,
            r"--expert-tensor-parallel-size=2: megatron-core's layer .* \(unset, ESP is --tensor-model-parallel-size",
        ),
        (
            ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2"],
            2,
            r"--expert-model-parallel-size=2: EP x expert-TP = 4 must divide the ranks per pipeline stage",
        ),
        (
            ["--moe-layer-impl", "mcore", "--moe-router-load-balancing-type", "top1_aux_loss"],
            1,
            r"=top1_aux_loss: mega",
        ),
        (["--moe-gate", "soft", "--moe-expert-capacity-factor", "1.0"], 1, r"-capacity-factor=1.0: --moe-gate=soft"),
    ],
)
def test_bad_layouts_name_flag_value_and_choice(flags, world, message):
    with pytest.raises(ConfigError, match=message):
        cfg(*flags).validate(world_size=world)


def test_our_layer_takes_global_aux_loss():
    """megatron-core's global-batch balancing loss, once refused by name in our layer (--moe-layer-impl mcore only)."""
    c = cfg("--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.01")
    c.validate(world_size=2)
    assert c.moe.own_layer and c.moe.layer_config(c.model).load_balancing == "global_aux_loss"


def test_loss_scale_flags():
    c = cfg("--fp16", "--initial-loss-scale", "4096", "--hysteresis", "1")
    assert (c.training.initial_loss_scale, c.training.hysteresis, c.training.loss_scale) == (4096.0, 1, None)
    with pytest.raises(ConfigError, match=r"--initial-loss-scale=0.5: must be >= --min-loss-scale=1.0"):
        cfg("--fp16", "--initial-loss-scale", "0.5").validate(1)
    with pytest.raises(ConfigError, match=r"--loss-scale=-1.0: must be positive"):
        cfg("--fp16", "--loss-scale", "-1").validate(1)


def test_context_parallel_without_transformer_engine_names_the_flag():
    import importlib.util

    from megatron_moe.model import transformer_config
    from megatron_moe.platform import current_platform

    if current_platform().is_accelerator and importlib.util.find_spec("transformer_engine"):
        pytest.skip("transformer-engine is here: context parallelism is available")
    with pytest.raises(ConfigError, match=r"--context-parallel-size=2 needs transformer-engine's attention"):
        transformer_config(cfg("--context-parallel-size", "2"))


def test_missing_data_flags():
    with pytest.raises(ConfigError, match="--data-path"):
        parse_args(["--tokenizer-model", "t"]).validate(1)
    with pytest.raises(ConfigError, match="--tokenizer-model"):
        parse_args(["--data-path", "d"]).validate(1)


def test_round_trip_through_dict():
    c = cfg("--num-layers", "6", "--swiglu", "--moe-pad-expert-input-to-capacity")
    assert RunConfig.from_dict(c.to_dict()) == c


OLD_SAVED_MOE_FLAGS = [
    # (as saved before the MoE flags were merged, what they mean now)
    (
        dict(moe_capacity_factor=1.25, moe_dispatcher="alltoall", moe_load_balancing=None),
        dict(moe_expert_capacity_factor=1.25, moe_pad_expert_input_to_capacity=True),
    ),
    (
        dict(moe_capacity_factor=None, moe_dispatcher="alltoallv", moe_load_balancing="gshard"),
        dict(moe_pad_expert_input_to_capacity=False, moe_router_load_balancing_type="top1_aux_loss"),
    ),
    (  # seq_aux_loss ran as switch in our layer
        dict(moe_load_balancing=None, moe_router_load_balancing_type="seq_aux_loss"),
        dict(moe_router_load_balancing_type="aux_loss"),
    ),
    (
        dict(moe_load_balancing="none", moe_router_load_balancing_type="aux_loss"),
        dict(moe_router_load_balancing_type="none"),
    ),
]


@pytest.mark.parametrize("old, new", OLD_SAVED_MOE_FLAGS)
def test_config_saved_under_the_old_moe_flags_loads_as_what_it_ran(old, new):
    """Checkpoints keep their run config; one saved before the MoE flags were merged still loads."""
    saved = cfg().to_dict()
    for name in new:
        saved["moe"].pop(name)
    saved["moe"].update(old)
    loaded = RunConfig.from_dict(saved)
    assert {name: getattr(loaded.moe, name) for name in new} == new
    loaded.validate(1)


# ---------------------------------------------------------------------------- one MoE configuration


def test_flags_become_the_layer_config_in_one_place():
    from megatron_moe.model.builder import moe_layer

    flags = (
        "--moe-expert-capacity-factor -1.5 --moe-pad-expert-input-to-capacity --swiglu --moe-ffn-hidden-size 96 "
        "--moe-router-load-balancing-type top1_aux_loss --moe-gate xmoe --moe-router-dim 8 --moe-z-loss-coeff 0.001 "
        "--moe-router-topk 1 --init-method-std 0.01 --moe-aux-loss-coeff 0.01"
    )
    c = cfg(*flags.split())
    layer = c.moe.layer_config(c.model)
    assert moe_layer(c) == layer  # the model builder takes exactly this config
    assert layer == MoELayerConfig(
        num_experts=8,
        hidden_size=256,
        ffn_hidden_size=96,
        topk=1,
        gate="xmoe",
        capacity_factor=-1.5,
        pad_expert_input_to_capacity=True,
        expert_type="swiglu",
        load_balancing="top1_aux_loss",
        aux_loss_coeff=0.01,
        z_loss_coeff=0.001,
        router_dim=8,
        init_method_std=0.01,
        pipeline_degree="auto",  # the run's default (the training set-up resolves it); a bare layer's is 1
        bp_pipeline_degree="auto",
    )
    assert layer.dispatcher == "padded_alltoall" and cfg().moe.layer_config(cfg().model).dispatcher == "alltoallv"
    assert moe_layer(cfg("--moe-layer-impl", "mcore")) is None
    assert moe_layer(parse_args(BASE[:4])) is None  # dense


def test_layer_config_errors_name_real_flags():
    """Every MoELayerConfig field names the run flag that sets it, and that flag exists."""
    flags = set(build_parser()._option_string_actions)
    for field in dataclasses.fields(MoELayerConfig):
        assert flag_name(field) in flags, field.name


LOGGED_ROUTER_LOSSES = [
    # (flags, balancing loss logged, z-loss logged)
    ("", True, False),
    ("--moe-z-loss-coeff 0.001", True, True),
    ("--moe-router-load-balancing-type none", False, False),
    ("--moe-router-load-balancing-type top1_aux_loss --moe-aux-loss-coeff 0", True, False),  # computed, weight 0
    ("--moe-gate expert_choice", False, False),  # balanced by construction: no loss to log
    ("--moe-gate expert_choice --moe-z-loss-coeff 0.001", False, True),
    ("--moe-gate soft", False, False),
    ("--moe-layer-impl mcore --moe-aux-loss-coeff 0.01", True, False),
    ("--moe-layer-impl mcore", False, False),  # the default 0 (Megatron-LM's): megatron-core then skips it
    (
        "--moe-layer-impl mcore --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01 "
        "--moe-z-loss-coeff 0.1",
        True,
        True,
    ),
    ("--moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 0.01", True, False),
    ("--moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 0", False, False),  # as megatron-core
]


@pytest.mark.parametrize("flags, aux, z", LOGGED_ROUTER_LOSSES)
def test_the_log_shows_the_router_losses_the_layers_compute(flags, aux, z):
    c = cfg(*flags.split())
    assert c.moe.logged_router_losses(c.model) == (aux, z)


# ---------------------------------------------------------------------------- flags that would do nothing

NO_OPS = [
    # (flags, the one start-up line: the flag as typed, and when it applies)
    ("--moe-router-dim 32", r"--moe-router-dim 32: changes nothing in this run \(it applies only with --moe-gate xmoe"),
    ("--moe-soft-slots 2", r"--moe-soft-slots 2: .* only with --moe-gate soft"),
    ("--hysteresis 1", r"--hysteresis 1: .* only with --fp16 and no --loss-scale"),
    ("--fp16 --loss-scale 128 --loss-scale-window 10", r"--loss-scale-window 10: .* with --fp16 and no --loss-scale"),
    ("--loss-scale 128", r"--loss-scale 128.0: .* only with --fp16 or --bf16"),
    ("--moe-grouped-gemm", r"--moe-grouped-gemm: .* only with --num-experts and --moe-layer-impl mcore"),
    ("--moe-layer-impl mcore --moe-gate xmoe", r"--moe-gate xmoe: .* only with --num-experts and our layer"),
    (
        "--moe-layer-impl mcore --moe-pad-expert-input-to-capacity",
        r"--moe-pad-expert-input-to-capacity: .* a positive --moe-expert-capacity-factor",
    ),
    ("--moe-router-load-balancing-type none --moe-aux-loss-coeff 0.1", r"--moe-aux-loss-coeff 0.1: .* other than none"),
    ("--moe-gate expert_choice --moe-router-load-balancing-type aux_loss", r"type aux_loss: .* not with --moe-gate"),
    ("--moe-gate switch --moe-router-topk 1 --no-moe-normalize-topk", r"--no-moe-normalize-topk: .*router-topk > 1"),
    ("--sequence-parallel", r"--sequence-parallel: .* only with --tensor-model-parallel-size > 1"),
    ("--lr-decay-style constant --min-lr 0", r"--min-lr 0.0: .* only with a --lr-decay-style other than constant"),
    ("--activation-quant-format fp8_row", r"--activation-quant-format fp8_row: .* only with --quantize-activations"),
    ("--save-interval 10", r"--save-interval 10: .* only with --save"),
    ("--no-load-optim", r"--no-load-optim: .* only with --load"),
    ("--position-embedding-type learned_absolute --rotary-base 500", r"--rotary-base 500: .* with --position-emb"),
]


@pytest.mark.parametrize("flags, message", NO_OPS)
def test_a_given_flag_that_would_do_nothing_is_accepted_with_one_line_saying_so(flags, message):
    c = cfg(*flags.split())
    assert len(c.notes) == 1 and re.search(message, c.notes[0]) and c.notes[0].startswith("--"), c.notes
    assert c.notes[0].endswith("); accepted and ignored"), c.notes
    words = flags.split()  # the run is the one without the flag: its field is set back to the default
    at = words.index(c.notes[0].split(":")[0].split()[0])
    without = words[:at] + words[at + (1 if at + 1 == len(words) or words[at + 1].startswith("--") else 2) :]
    assert c.to_dict() == cfg(*without).to_dict()


def test_the_tools_that_have_no_start_up_log_still_refuse_it():
    from megatron_moe.config import GROUPS
    from megatron_moe.config.fields import check_given_flags_apply

    c = cfg()
    c.moe.moe_router_dim = 32
    with pytest.raises(ConfigError, match=r"--moe-router-dim=32: does nothing in this run; it applies only with"):
        check_given_flags_apply(c, GROUPS, {"moe_router_dim"})


def test_moe_flags_need_an_moe_model_and_defaults_never_count():
    dense = ["--data-path", "d", "--tokenizer-model", "t.model"]
    c = parse_args(dense)
    c.validate(2)  # every MoE field keeps its default: nothing given, no line
    assert c.notes == []
    for flags in (["--moe-router-topk", "2"], ["--expert-model-parallel-size", "1"], ["--moe-layer-impl", "mcore"]):
        (line,) = parse_args([*dense, *flags]).notes
        assert line.startswith(f"{' '.join(flags)}: changes nothing in this run (it applies only with --num-experts")


def test_flags_that_apply_are_accepted():
    flags = (
        "--moe-gate xmoe --moe-router-dim 8 --fp16 --hysteresis 1 --bf16 --no-bf16 --tensor-model-parallel-size 2 "
        "--sequence-parallel --moe-layer-freq 2 --quantize-activations expert_fc1 --activation-quant-format int8_block "
        "--save s --save-interval 5 --load s --no-load-rng"
    )
    c = cfg(*flags.split())
    assert (c.moe.moe_router_dim, c.training.hysteresis, c.checkpoint.save_interval) == (8, 1, 5)
    mcore = "--moe-layer-impl mcore --moe-grouped-gemm --moe-expert-capacity-factor 1.5 "
    mcore += "--moe-pad-expert-input-to-capacity --moe-router-load-balancing-type seq_aux_loss"
    m = cfg(*mcore.split())
    m.validate(1)
    assert m.moe.moe_grouped_gemm and m.moe.moe_pad_expert_input_to_capacity


# ---------------------------------------------------------------- the interleaved pipeline (virtual stages)

PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize(
    "flags, chunks",
    [
        ([*PP2, "--num-virtual-stages-per-pipeline-rank", "2"], 2),
        ([*PP2, "--num-layers-per-virtual-pipeline-stage", "1"], 2),  # 4 layers / PP 2 / 1 per chunk
        ([*PP2, "--num-layers-per-virtual-pipeline-stage", "2"], None),  # one chunk per rank: plain 1F1B
        ([*PP2, "--num-virtual-stages-per-pipeline-rank", "1"], None),
        (["--num-layers", "8", *PP2, "--num-virtual-stages-per-pipeline-rank", "4"], 4),
        (PP2, None),
    ],
)
def test_virtual_pipeline_flags_give_megatron_lms_chunks_per_rank(flags, chunks):
    c = cfg(*flags, "--global-batch-size", "8", "--micro-batch-size", "2")
    c.validate(world_size=4)  # DP 2: 2 micro-batches, a multiple of PP
    assert c.parallel.virtual_pipeline_size(c.model.num_layers) == chunks


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (
            [*PP2, "--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
            2,
            r"--num-layers-per-virtual-pipeline-stage=1: give it or --num-virtual-stages-per-pipeline-rank=2, not both",
        ),
        (
            [*PP2, "--num-virtual-stages-per-pipeline-rank", "3"],
            2,
            r"--num-virtual-stages-per-pipeline-rank=3: --num-layers=4 must be a multiple of "
            r"--pipeline-model-parallel-size x chunks = 2 x 3, e\.g\. --num-virtual-stages-per-pipeline-rank 2",
        ),
        (
            ["--num-layers", "6", *PP2, "--num-layers-per-virtual-pipeline-stage", "2"],
            2,
            r"--num-layers-per-virtual-pipeline-stage=2: must divide the layers per pipeline stage "
            r"\(--num-layers=6 / --pipeline-model-parallel-size=2\), e\.g\. 1",
        ),
        (
            [*PP2, "--num-virtual-stages-per-pipeline-rank", "0"],
            2,
            r"--num-virtual-stages-per-pipeline-rank=0: must be > 0, e\.g\. --num-virtual-stages-per-pipeline-rank 1",
        ),
        (
            [
                *PP2,
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--micro-batch-size",
                "2",
                "--global-batch-size",
                "6",
            ],
            2,
            r"--global-batch-size=6: the interleaved pipeline \(2 model chunks per pipeline rank\) needs a number "
            r"of micro-batches that is a multiple of --pipeline-model-parallel-size=2, .* = 3; e\.g\. "
            r"--global-batch-size 8",
        ),
        (
            [*PP2, "--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "2"],
            4,  # DP 2, global batch 4 by default: one micro-batch
            r"--global-batch-size=4: .* = 4 / \(2 x 2\) = 1; e\.g\. --global-batch-size 8",
        ),
    ],
)
def test_bad_virtual_pipeline_flags_name_flag_value_and_choice(flags, world, message):
    with pytest.raises(ConfigError, match=message):
        cfg(*flags).validate(world_size=world)


def test_virtual_pipeline_needs_a_pipeline():
    for flag in ("--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage"):
        c = cfg(flag, "2")  # typed at PP=1: it changes nothing, and a line says so
        assert c.notes == [
            f"{flag} 2: changes nothing in this run (it applies only with --pipeline-model-parallel-size > 1); "
            "accepted and ignored"
        ]
        c.validate(world_size=1)
        assert c.parallel.virtual_pipeline_size(c.model.num_layers) is None
    c = cfg()
    c.parallel.num_virtual_stages_per_pipeline_rank = 2  # e.g. from a saved config: no flag to refuse
    with pytest.raises(ConfigError, match=r"=2: .* it needs --pipeline-model-parallel-size > 1 \(now 1\), e\.g\."):
        c.validate(world_size=1)


def test_a_typed_adaptive_gradient_reduction_is_named_as_changing_nothing_under_the_interleaved_pipeline():
    vpp = [*PP2, "--num-virtual-stages-per-pipeline-rank", "2", "--expert-model-parallel-size", "2"]
    assert (
        cfg(*vpp, "--grad-reduce-schedule", "adaptive")
        .notes[0]
        .startswith(
            "--grad-reduce-schedule adaptive: changes nothing in this run (it applies only without the interleaved "
            "pipeline (--num-virtual-stages-per-pipeline-rank / --num-layers-per-virtual-pipeline-stage)"
        )
    )
    assert cfg(*vpp, "--grad-reduce-schedule", "megatron").parallel.grad_reduce_schedule == "megatron"
    default = cfg(*vpp)  # adaptive by default: falls back to megatron-core's buckets at set-up, saying why
    from megatron_moe.training.setup import adaptive_refused

    assert "the interleaved pipeline, 2 model chunks per pipeline rank" in adaptive_refused(default)
    assert adaptive_refused(cfg(*PP2, "--expert-model-parallel-size", "2")) is None
