"""--num-distributed-optimizer-instances (Megatron-LM's partial distributed optimizer): the flag pass. Training with
it equals the single-process run, and a distributed-optimizer checkpoint resumes into it
(tests/distributed/test_training.py, `ep2_distopt_2instances`)."""

import pytest

from megatron_moe.config import ConfigError, parse_args
from megatron_moe.training.setup import adaptive_refused

BASE = ["--data-path", "d", "--tokenizer-model", "t", "--num-experts", "4", "--expert-model-parallel-size", "2"]


def validated(world: int, *flags: str):
    cfg = parse_args([*BASE, *flags])
    cfg.validate(world)
    return cfg


def test_two_instances_of_two_data_parallel_ranks_pass_and_the_gradient_reduction_stays_megatron_cores():
    cfg = validated(4, "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2")
    assert cfg.parallel.num_distributed_optimizer_instances == 2
    assert "2 distributed-optimizer instances: megatron-core reduces" in adaptive_refused(cfg)


@pytest.mark.parametrize(
    "world, flags, named",
    [
        (4, ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "0"], "=0: must be > 0"),
        # expert DP = 4 / 2 = 2 is not a multiple of 4 instances
        (
            4,
            ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "4"],
            r"=4: must divide DP x CP \(4\) and expert DP \(2\)",
        ),
    ],
)  # fmt: skip
def test_the_flag_pass_refuses_by_name(world, flags, named):
    with pytest.raises(ConfigError, match=named):
        validated(world, *flags)


@pytest.mark.parametrize(
    "flags, note",
    [
        (["--num-distributed-optimizer-instances", "2"], "--num-distributed-optimizer-instances 2: changes nothing"),
        (
            ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
            + ["--grad-reduce-schedule", "adaptive"],
            "--grad-reduce-schedule adaptive: changes nothing in this run (it applies only without the interleaved",
        ),
    ],
)  # fmt: skip
def test_where_it_changes_nothing_a_line_says_so(flags, note):
    notes = validated(4, *flags).notes
    assert len(notes) == 1 and notes[0].startswith(note), notes
