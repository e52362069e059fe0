"""--pipeline-model-parallel-layout: the flag pass reads and checks the string as megatron-core 0.16.1 does
(`PipelineParallelLayerLayout`), without importing it; refused by name before start-up where megatron-core would
assert after it."""

import pytest
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from megatron_moe.config import ConfigError, parse_args
from megatron_moe.config.pipeline_layout import check_pipeline_layout, pipeline_layout_stages

# (layout, PP, --num-layers, --mtp-num-layers): Megatron-LM's functional-test layouts, DeepSeek-V3's, and wrong ones
CASES = [
    ("Et*3|(tt|)*6L", 2, 15, None),
    ("Et*3|(tt|)*6tmL", 2, 16, 1),
    ("Et|(tt|)*6mL", 2, 13, 1),
    ("Et*3|(tt|)*29,mL", 16, 61, 1),  # DeepSeek-V3's 61 layers on 16 x 2 stages, the MTP layer with the loss
    ("Et*3|tL", 2, 4, None),
    ("Et|t|t|tmL", 2, 4, 1),
    ("Ex|tL", 2, 2, None),  # unknown symbol
    ("Et|t|tL", 2, 3, None),  # 3 stages on PP=2
    ("Et|tt", 2, 3, None),  # no loss
    ("tE|tL", 2, 2, None),  # the embedding not first
    ("EEt|tL", 2, 2, None),  # two embeddings
    ("Et*3|tL", 2, 5, None),  # 4 layers placed, 5 asked
    ("Et|tL", 2, 2, 1),  # the MTP layer not placed
    ("Em|tL", 2, 1, 1),  # the MTP layer before a transformer layer
    ("Et|m|t|tL", 2, 3, 1),  # the MTP layer in a chunk before the last
    ("Et|t|tm|mL", 2, 3, 2),  # the MTP layers split over two stages
]


STANDALONE_MTP = [("Et*3|(tt|)*29,m|L", 16, 61, 1), ("Ett|tt|m|L", 2, 4, 1)]
"""megatron-core's standalone MTP stage (the MTP layers on a rank before the last; DeepSeek-V3's published layout):
megatron-core accepts it, this stack refuses it by name (a run with it did not finish its first step here)."""


def megatron_core_accepts(layout: str, pp: int, layers: int, mtp: int | None) -> bool:
    try:
        PipelineParallelLayerLayout(layout, pp).validate_layer_layout(num_layers=layers, mtp_num_layers=mtp)
    except (AssertionError, ValueError, KeyError, NotImplementedError):
        return False
    return True


def we_accept(layout: str, pp: int, layers: int, mtp: int | None) -> bool:
    try:
        check_pipeline_layout(layout, pp, layers, mtp)
    except ConfigError as error:
        assert str(error).startswith(f"--pipeline-model-parallel-layout={layout}: "), error
        return False
    return True


@pytest.mark.parametrize(("layout", "pp", "layers", "mtp"), CASES)
def test_the_flag_pass_refuses_exactly_what_megatron_core_would(layout, pp, layers, mtp):
    assert we_accept(layout, pp, layers, mtp) == megatron_core_accepts(layout, pp, layers, mtp)


@pytest.mark.parametrize("layout", sorted({case[0] for case in CASES} - {"Ex|tL"}))
def test_the_stages_are_megatron_cores(layout):
    stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
    expected = ["".join(layer.name[0] for layer in stage) for stage in stages]
    ours = [stage.replace("E", "e").replace("t", "d").replace("L", "l") for stage in pipeline_layout_stages(layout)]
    assert ours == expected  # megatron-core's LayerType names: embedding, decoder, mtp, loss


FLAGS = ["--num-experts", "4", "--num-attention-heads", "4", "--hidden-size", "64", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "128", "--global-batch-size", "8"]  # fmt: skip


def test_a_layout_gives_the_model_chunks_and_frees_the_layer_count_from_pp():
    cfg = parse_args([*FLAGS, "--num-layers", "15", "--pipeline-model-parallel-size", "2",
                      "--pipeline-model-parallel-layout", "Et*3|(tt|)*6L"])  # fmt: skip
    cfg.validate(2)
    assert cfg.parallel.virtual_pipeline_size(15) == 4
    assert cfg.dims(2).vpp == 4
    even = parse_args([*FLAGS, "--num-layers", "15", "--pipeline-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match=r"--pipeline-model-parallel-size=2: must divide --num-layers=15 .*layout"):
        even.validate(2)
    one_chunk = parse_args([*FLAGS, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                            "--pipeline-model-parallel-layout", "Et*3|tL"])  # fmt: skip
    one_chunk.validate(2)
    assert one_chunk.parallel.virtual_pipeline_size(4) is None


def test_a_layout_with_a_virtual_stage_flag_is_refused_naming_both():
    layout = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|t|t|tL"]
    cfg = parse_args([*FLAGS, "--num-layers", "4", *layout, "--num-virtual-stages-per-pipeline-rank", "2"])
    with pytest.raises(ConfigError, match=r"layout=Et\|t\|t\|tL: sets the model chunks .* --num-virtual-stages-per"):
        cfg.validate(2)


@pytest.mark.parametrize(("layout", "pp", "layers", "mtp"), STANDALONE_MTP)
def test_a_standalone_mtp_stage_is_refused_by_name_where_megatron_core_takes_it(layout, pp, layers, mtp):
    assert megatron_core_accepts(layout, pp, layers, mtp)
    with pytest.raises(ConfigError, match=r"the MTP layers \(m\) go on the last pipeline rank.*standalone"):
        check_pipeline_layout(layout, pp, layers, mtp)
