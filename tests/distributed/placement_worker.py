"""A shared job's part (job_runner.py, 4 ranks): --expert-placement e+d, d+e and auto at EP=2 x expert-DP=2, in one job.

    argv: DATA_PREFIX TOKENIZER WORKDIR

Cases, each a short fp32 run from the same seed (expert e's initial weights depend on (seed, layer, e) alone, the
dense ones on the seed: both placements start from the same model):
- `e+d`, `d+e`: 4 steps each, saved at step 2; every rank's EP, expert-DP and DP groups as the run built them;
- `d+e_as_e+d`, `e+d_as_d+e`: the other placement's step-2 checkpoint resumed for steps 3 and 4;
- `d+e_resumed`: d+e's step-2 checkpoint resumed under d+e (resume exactness in the new placement);
- `auto`: one step with --expert-placement auto while this job pretends to be 2 nodes of 2 ranks
  (LOCAL_WORLD_SIZE=2): the groups it built, and the placement the rule picks for the run's shapes.
"""

import os
import sys
from unittest import mock

import torch.distributed as dist

from tests.distributed.launcher import train_in_job

DATA, TOKENIZER, WORKDIR = sys.argv[1:4]
MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--eval-iters", "0",
    "--eval-interval", "0", "--log-interval", "1", "--data-path", DATA, "--tokenizer-model", TOKENIZER,
    "--split", "90,10,0", "--seed", "7", "--log-params-norm", "--expert-model-parallel-size", "2",
    "--moe-pipeline-degree", "1", "--moe-bp-pipeline-degree", "1", "--grad-reduce-schedule", "megatron",
]  # fmt: skip


def run(*flags: str) -> dict:
    """One run: the logging rank's history, and every rank's groups as the run built them (read at its shutdown)."""
    from megatron.core import parallel_state

    import megatron_moe.training as training

    mine = {}

    def shutdown(**kwargs):
        mine.update(
            ep=dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()),
            expert_dp=dist.get_process_group_ranks(parallel_state.get_expert_data_parallel_group()),
            dp=dist.get_process_group_ranks(parallel_state.get_data_parallel_group(with_context_parallel=True)),
        )
        shutdown_run(**kwargs)

    shutdown_run = training.shutdown
    with mock.patch.object(training, "shutdown", shutdown):
        history = train_in_job([*MODEL, *flags])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    groups = {name: sorted({tuple(g[name]) for g in everyone}) for name in mine}
    return {"history": history, "groups": {name: [list(g) for g in gs] for name, gs in groups.items()}}


def ckpt(name: str) -> str:
    return os.path.join(WORKDIR, name)


def auto() -> dict:
    """--expert-placement auto on a pretended 2 nodes x 2 ranks, and what the rule picks for this run."""
    from megatron_moe.config import parse_args, placement

    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "2"}):
        result = run("--train-iters", "1", "--expert-placement", "auto")
    cfg = parse_args([*MODEL, "--train-iters", "1", "--expert-placement", "auto"])
    cfg.validate(dist.get_world_size())
    dims = cfg.dims(dist.get_world_size())
    volumes = placement.StepVolumes.of(cfg, dims)
    result["picked"], result["why"] = placement.choose(dims, 2, volumes)
    result["expected_groups"] = placement.groups(dims, result["picked"])
    return result


def cases() -> dict:
    results = {}
    for p in ("e+d", "d+e"):
        results[p] = run("--train-iters", "4", "--expert-placement", p, "--save", ckpt(p), "--save-interval", "2")
    resume = ["--train-iters", "4", "--load"]
    results["d+e_as_e+d"] = run(*resume, ckpt("d+e/iter_0000002"), "--expert-placement", "e+d")
    results["e+d_as_d+e"] = run(*resume, ckpt("e+d/iter_0000002"), "--expert-placement", "d+e")
    results["d+e_resumed"] = run(*resume, ckpt("d+e/iter_0000002"), "--expert-placement", "d+e")
    results["auto"] = auto()
    return results
