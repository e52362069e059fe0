"""Flag parsing and the errors for bad layouts and batch sizes."""

import pytest

from megatron_moe.config import ConfigError, build_parser, parse_args

BASE = ["--data-path", "d", "--tokenizer-model", "t.model", "--num-experts", "8"]


def cfg(*flags):
    return parse_args([*BASE, *flags])


def test_every_issue_flag_exists():
    flags = set(build_parser()._option_string_actions)
    for flag in ("--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --seq-length "
                 "--num-experts --moe-router-topk --moe-aux-loss-coeff --tensor-model-parallel-size "
                 "--pipeline-model-parallel-size --expert-model-parallel-size --sequence-parallel "
                 "--micro-batch-size --global-batch-size --train-iters --lr --min-lr --lr-warmup-iters "
                 "--lr-decay-style --weight-decay --clip-grad --bf16 --fp16 --seed --data-path --split "
                 "--tokenizer-model --save --load --save-interval --eval-interval --eval-iters "
                 "--log-interval --tensorboard-dir --moe-layer-freq --use-distributed-optimizer").split():
        assert flag in flags, flag


def test_defaults_fill_global_batch():
    c = cfg("--micro-batch-size", "2")
    c.validate(world_size=4)
    assert c.training.global_batch_size == 8 and c.num_microbatches(4) == 1


def test_moe_layer_freq():
    assert cfg("--moe-layer-freq", "2").moe.layer_pattern(4) == [1, 0, 1, 0]
    assert cfg("--moe-layer-freq", "[0,1,1,0]").moe.layer_pattern(4) == [0, 1, 1, 0]
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        cfg("--moe-layer-freq", "[1,0]").moe.layer_pattern(4)


@pytest.mark.parametrize("flags, world, message", [
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6,
     r"world size=6: must be a multiple of TP x PP x CP = 2 x 2 x 1 = 4"),
    (["--expert-model-parallel-size", "3"], 3, r"--num-experts=8: must be a multiple of --expert-model-parallel-size=3"),
    (["--tensor-model-parallel-size", "2"], 2, r"--sequence-parallel=False: MoE with --tensor-model-parallel-size=2 needs --sequence-parallel"),
    (["--micro-batch-size", "4", "--global-batch-size", "10"], 2, r"--global-batch-size=10: must be a multiple of --micro-batch-size x data-parallel size = 4 x 2 = 8"),
    (["--moe-router-topk", "9"], 1, r"--moe-router-topk=9: must be between 1 and --num-experts=8"),
    (["--num-attention-heads", "3"], 1, r"--hidden-size=256: must be a multiple of --num-attention-heads=3"),
    (["--bf16", "--fp16"], 1, r"--bf16/--fp16=both: choose one"),
    (["--pipeline-model-parallel-size", "3"], 3, r"--pipeline-model-parallel-size=3: must divide --num-layers=4"),
    (["--expert-model-parallel-size", "4"], 2, r"--expert-model-parallel-size=4: EP x expert-TP = 4 must divide"),
])  # fmt: skip
def test_bad_layouts_name_flag_value_and_choice(flags, world, message):
    with pytest.raises(ConfigError, match=message):
        cfg(*flags).validate(world_size=world)


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
    from megatron_moe.config import RunConfig

    c = cfg("--num-layers", "6", "--swiglu")
    assert RunConfig.from_dict(c.to_dict()) == c
