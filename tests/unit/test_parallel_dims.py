"""ParallelDims: the layout's derived sizes are megatron-core's, and its checks name the flag.

megatron-core's own `parallel_state.initialize_model_parallel` runs here over a pretend world (rank 0's view:
torch.distributed answers for N ranks and `new_group` records each group's ranks), so the data-parallel,
expert-data-parallel and expert group sizes compared with are the ones it builds, not a copy of its formulas.
"""

import warnings
from unittest import mock

import pytest
import torch.distributed as dist

from megatron_moe.config import ConfigError, ParallelDims, RunConfig, parse_args
from megatron_moe.config.groups import ParallelConfig

BASE = ["--data-path", "d", "--tokenizer-model", "t.model"]


class _Group:
    """What megatron-core reads back from a process group: its ranks, this rank's place."""

    def __init__(self, ranks):
        self.ranks = list(ranks)

    def size(self):
        return len(self.ranks)

    def rank(self):
        return self.ranks.index(0) if 0 in self.ranks else -1


def megatron_core_sizes(world: int, *, tp: int, pp: int, cp: int, ep: int, esp: int) -> dict[str, int]:
    """The group sizes megatron-core's initialize_model_parallel gives rank 0 of a `world`-rank job."""
    from megatron.core import parallel_state

    def world_size(group=None):
        return world if group is None else group.size()

    def rank(group=None):
        return 0 if group is None else group.rank()

    assert not parallel_state.model_parallel_is_initialized()
    with (
        mock.patch.object(dist, "is_initialized", lambda: True),
        mock.patch.object(dist, "get_world_size", world_size),
        mock.patch.object(dist, "get_rank", rank),
        mock.patch.object(dist, "new_group", lambda ranks=None, **_: _Group(ranks)),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=esp,
            create_gloo_process_groups=False,
        )
        try:
            return {
                "dp": parallel_state.get_data_parallel_world_size(),
                "expert_dp": parallel_state.get_expert_data_parallel_world_size(),
                "esp": parallel_state.get_expert_tensor_parallel_world_size(),
                "ep": parallel_state.get_expert_model_parallel_world_size(),
                "expert_shards": parallel_state.get_expert_tensor_and_model_parallel_group().size(),
                "replica_size": parallel_state.get_model_parallel_group().size()
                * parallel_state.get_context_parallel_world_size(),
            }
        finally:
            parallel_state.destroy_model_parallel()


def dims_of(world: int, *, tp=1, pp=1, cp=1, ep=1, esp=None, sp=False, **flags) -> ParallelDims:
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=esp,
        sequence_parallel=sp,
        **flags,
    )
    return ParallelDims.from_config(parallel, world)


LAYOUTS = [
    # world, tp, pp, cp, ep, esp
    (1, 1, 1, 1, 1, 1),
    (8, 1, 1, 1, 8, 1),
    (8, 2, 1, 1, 2, 2),
    (8, 1, 2, 1, 2, 2),
    (16, 2, 2, 2, 2, 1),  # context parallelism folds into the expert data-parallel size: 16 / (2 x 2 x 1) = 4
    (16, 2, 1, 2, 4, 1),
    (32, 4, 2, 1, 2, 4),
    (24, 3, 2, 1, 2, 3),
]


@pytest.mark.parametrize("world,tp,pp,cp,ep,esp", LAYOUTS)
def test_the_derived_sizes_are_megatron_cores(world, tp, pp, cp, ep, esp):
    dims = dims_of(world, tp=tp, pp=pp, cp=cp, ep=ep, esp=esp)
    dims.validate()
    assert megatron_core_sizes(world, tp=tp, pp=pp, cp=cp, ep=ep, esp=esp) == {
        "dp": dims.dp,
        "expert_dp": dims.expert_dp,
        "esp": dims.esp,
        "ep": dims.ep,
        "expert_shards": dims.expert_shards,
        "replica_size": dims.replica_size,
    }
    assert dims.ranks_per_stage == dims.tp * dims.cp * dims.dp == dims.ep * dims.esp * dims.expert_dp


def test_the_sizes_of_a_layout():
    dims = dims_of(16, tp=2, pp=2, cp=2, ep=2, esp=1)
    assert (dims.esp, dims.replica_size, dims.dp, dims.ranks_per_stage) == (1, 8, 2, 8)
    assert (dims.expert_shards, dims.expert_dp) == (2, 4)
    assert (dims.sequence_split, dims.token_split) == (1, 2)  # CP alone splits the tokens without SP
    sp = dims_of(16, tp=2, pp=2, cp=2, ep=2, sp=True)
    assert (sp.sequence_split, sp.token_split) == (2, 4)
    assert dims_of(4, tp=4).sequence_split == 1  # TP without SP: every TP rank holds the whole sequence


def test_unset_expert_tensor_parallel_size_is_tp_as_in_megatron_lm():
    """Megatron-LM's arguments.py: an unset --expert-tensor-parallel-size is --tensor-model-parallel-size."""
    dims = dims_of(8, tp=2, ep=2, esp=None)
    assert dims.esp == 2 and dims.expert_dp == 2
    assert megatron_core_sizes(8, tp=2, pp=1, cp=1, ep=2, esp=2)["expert_dp"] == dims.expert_dp
    assert dims_of(8, tp=2, ep=2, esp=1).esp == 1  # given: as given


def test_the_virtual_pipeline_comes_from_either_flag():
    parallel = ParallelConfig(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2)
    assert ParallelDims.from_config(parallel, 4, num_layers=8).vpp == 2
    assert ParallelDims.from_config(parallel, 4).vpp is None  # no layers given: not worked out
    chunks = ParallelConfig(pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=4)
    assert ParallelDims.from_config(chunks, 2, num_layers=8).vpp == 4
    assert ParallelDims.from_config(ParallelConfig(pipeline_model_parallel_size=2), 2, num_layers=8).vpp is None


def test_the_world_when_not_given():
    parallel = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
    )
    smallest = ParallelDims.from_config(parallel)
    assert smallest.world == smallest.smallest_world == 2 * 4  # PP x lcm(TP x CP, EP x ESP)
    smallest.validate()
    assert smallest.dp == 2 and smallest.expert_dp == 1
    by_dp = ParallelDims.from_config(parallel, data_parallel_size=3)
    assert (by_dp.world, by_dp.dp) == (12, 3)
    with pytest.raises(TypeError):
        ParallelDims.from_config(parallel, 12, data_parallel_size=3)


def test_run_config_dims():
    cfg = parse_args([*BASE, "--num-layers", "8", "--pipeline-model-parallel-size", "2", "--global-batch-size", "16"])
    cfg.parallel.num_virtual_stages_per_pipeline_rank = 2
    cfg.validate(world_size=4)
    dims = cfg.dims(4)
    assert (dims.world, dims.pp, dims.vpp, dims.dp) == (4, 2, 2, 2)
    assert cfg.num_microbatches(4) == cfg.training.global_batch_size // (cfg.training.micro_batch_size * 2)
    assert RunConfig().dims().world == 1


@pytest.mark.parametrize(
    "layout,message",
    [
        ({"tp": 0}, "--tensor-model-parallel-size=0: must be >= 1"),
        ({"pp": -1}, "--pipeline-model-parallel-size=-1: must be >= 1"),
        ({"cp": 0}, "--context-parallel-size=0: must be >= 1"),
        ({"ep": 0}, "--expert-model-parallel-size=0: must be >= 1"),
        ({"esp": -2}, "--expert-tensor-parallel-size=-2: must be >= 1"),
        (
            {"tp": 2, "pp": 2},
            "world size=6: must be a multiple of TP x PP x CP = 2 x 2 x 1 = 4; valid world sizes are multiples "
            "of 4, or change the parallel sizes",
        ),
        (
            {"ep": 4},
            "--expert-model-parallel-size=4: EP x expert-TP = 4 must divide the ranks per pipeline stage "
            "(6 = world 6 / PP 1)",
        ),
        (
            {"pp": 3, "ep": 2, "esp": 2},
            "--expert-model-parallel-size=2: EP x expert-TP = 4 must divide the ranks per pipeline stage "
            "(2 = world 6 / PP 3)",
        ),
    ],
)
def test_a_layout_that_cannot_be_is_refused_naming_the_flag(layout, message):
    with pytest.raises(ConfigError) as error:
        dims_of(6, **layout).validate()
    assert str(error.value) == message


def test_the_run_config_refuses_the_same_layouts_with_the_same_words():
    with pytest.raises(ConfigError, match=r"^world size=6: must be a multiple of TP x PP x CP = 4 x 1 x 1 = 4;"):
        parse_args([*BASE, "--tensor-model-parallel-size", "4", "--sequence-parallel"]).validate(world_size=6)
    moe = [*BASE, "--num-experts", "8", "--expert-model-parallel-size", "4"]
    with pytest.raises(ConfigError, match=r"^--expert-model-parallel-size=4: EP x expert-TP = 4 must divide"):
        parse_args(moe).validate(world_size=6)
    with pytest.raises(ConfigError, match=r"^--seq-length=250: must be a multiple of --tensor-model-parallel-size"):
        parse_args([*BASE, "--tensor-model-parallel-size", "4", "--sequence-parallel", "--seq-length", "250"]).validate(
            world_size=4
        )
