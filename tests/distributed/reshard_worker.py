"""torchrun worker for test_reshard.py: train, reshard in-process, resume; results as JSON.

    torchrun --nproc-per-node N reshard_worker.py SCENARIO DATA_PREFIX TOKENIZER WORKDIR

Scenarios:
- `source` (1 rank): train steps 1-2 of 4 and save WORKDIR/src; then resume
  it in the same layout for steps 3-4 (the reference); save the initial
  weights (WORKDIR/init) and train all 4 steps from them.
- `chain` (2 ranks): starting from WORKDIR/ep2 (written by the convert.py
  CLI from src), reshard with the tool's own converter, one hop after the
  other: EP2 -> TP2+SP -> PP2 -> TP1/PP1/EP1, EP2 -> ESP2 -> EP2, PP2 -> PP2 x VPP2 -> PP1; and src -> EP2 with the
  distributed optimizer, weights only. Each result is resumed in its target
  layout for steps 3-4; and, with dropout, the TP2 result against its source
  resumed directly in TP2; PP=2 x VPP=2 from the initial weights and from src
  directly (2 ranks). The hops run in this one job because a torchrun
  start costs 10-20 s here.
"""

import os
import sys

from tests.distributed.launcher import finish_job, train_in_job  # light: the heavy imports are inside functions
from tools.checkpoint.reshard import Target  # light too

SCENARIO, DATA, TOKENIZER, WORKDIR = sys.argv[1:5]
ITERS, SAVED_AT = 4, 2

MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--eval-iters", "0",
    "--eval-interval", "0", "--log-interval", "1", "--data-path", DATA, "--tokenizer-model", TOKENIZER,
    "--split", "98,2,0", "--seed", "7", "--train-iters", str(ITERS),
    # compared runs: no start-up-timed pipeline degrees or gradient partition
    "--moe-pipeline-degree", "1", "--moe-bp-pipeline-degree", "1", "--grad-reduce-schedule", "megatron",
]  # fmt: skip

VPP2_FLAGS = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
# name: (the checkpoint it is made from, the target, the training flags of that layout)
HOPS = {
    "tp2_sp": (
        "ep2",
        Target(tensor_parallel_size=2, expert_parallel_size=1),  # ESP unset: the source's (1)
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"],
    ),
    "pp2": (
        "tp2_sp",
        Target(tensor_parallel_size=1, pipeline_parallel_size=2),
        ["--pipeline-model-parallel-size", "2"],
    ),
    "back_to_1": ("pp2", Target(pipeline_parallel_size=1), []),
    # ESP: each expert's FFN width split over 2 ranks (ESP), and back to EP=2.
    "esp2": (
        "ep2",
        Target(expert_parallel_size=1, expert_tensor_parallel_size=2),
        ["--expert-tensor-parallel-size", "2"],
    ),
    "esp2_to_ep2": (
        "esp2",
        Target(expert_parallel_size=2, expert_tensor_parallel_size=1),
        ["--expert-model-parallel-size", "2"],
    ),
    # The interleaved pipeline, 2 model chunks per pipeline rank, and from it straight back to PP=1.
    "pp2_vpp2": ("pp2", Target(virtual_stages=2), VPP2_FLAGS),
    "vpp2_to_1": ("pp2_vpp2", Target(pipeline_parallel_size=1), []),
    "ep2_distopt_weights_only": (
        "src",
        Target(expert_parallel_size=2, use_distributed_optimizer=True, drop_optimizer=True),
        ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
    ),
}
EP2_FLAGS = ["--expert-model-parallel-size", "2"]


def ckpt(name: str) -> str:
    return os.path.join(WORKDIR, name)


def train(*extra: str) -> list[dict]:
    """One run; every rank returns the logging rank's per-step figures."""
    return train_in_job([*MODEL, *extra])


def facts(root: str) -> dict:
    """What the saved checkpoint says about itself (common state, JSON-able parts)."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read())
    common = dist_checkpointing.load_common_state_dict(os.path.join(root, f"iter_{iteration:07d}"))
    keys = ("layout", "train_state", "scheduler", "has_optimizer", "distributed_optimizer")
    return {"iteration": iteration, "parallel": common["config"]["parallel"], **{k: common[k] for k in keys}}


def source() -> dict:
    train("--exit-interval", str(SAVED_AT), "--save", ckpt("src"))
    train("--train-iters", "0", "--save", ckpt("init"))  # the initial weights, for whole runs in other layouts
    return {
        "reference": train("--load", ckpt("src")),
        "src": facts(ckpt("src")),
        "from_init": train("--load", ckpt("init")),
    }


def chain() -> dict:
    from tools.checkpoint.reshard import make_reshard_job, reshard_on_this_rank

    results = {"ep2": {"resumed": train("--load", ckpt("ep2"), *EP2_FLAGS), **facts(ckpt("ep2"))}}
    for name, (origin, target, flags) in HOPS.items():
        job = make_reshard_job(ckpt(origin), ckpt(name), target)
        reshard_on_this_rank(job, ckpt(name), keep_process_group=True)
        results[name] = {
            "resumed": train("--load", ckpt(name), *flags),
            "world_size": job.world_size,
            **facts(ckpt(name)),
        }
    # PP=2 x VPP=2 on these 2 ranks, all 4 steps from the initial weights, and the source resumed there
    # directly (resharded at load, optimizer state included).
    results["pp2_vpp2_from_init"] = train("--load", ckpt("init"), *VPP2_FLAGS)
    results["pp2_vpp2_direct"] = train("--load", ckpt("src"), *VPP2_FLAGS)
    # RNG across layouts: with dropout, resuming the resharded TP2 checkpoint must equal resuming
    # its EP2 source directly in TP2 (both start from the TP2 layout's fresh seeds).
    tp2, dropout = HOPS["tp2_sp"][2], ["--hidden-dropout", "0.1"]
    results["dropout_direct"] = train("--load", ckpt("ep2"), *tp2, *dropout)
    results["dropout_resharded"] = train("--load", ckpt("tp2_sp"), *tp2, *dropout)
    return results


# Heavy imports stay out of module level: the checkpoint writer spawns a helper process that
# re-imports this script, and importing megatron-core there costs seconds per rank and job.
if __name__ == "__main__":
    finish_job({"source": source, "chain": chain}[SCENARIO]())
