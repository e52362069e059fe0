"""torchrun worker: many short training runs in one job, results as JSON for pytest.

    torchrun --nproc-per-node N train_worker.py SCENARIO DATA_PREFIX TOKENIZER WORKDIR

Scenarios (each a list of cases run one after another in this job):
- `reference` (1 rank): save the initial weights, then train from them
  (fp32, and fp16 with a loss scale that fits and one that overflows);
  megatron-core's MoE layer (--moe-layer-impl mcore) likewise; one step each
  of runs that compute no balancing loss (what their log shows).
- `layouts` (4 ranks): TP=2, EP=2, PP=2, TP=2+EP=2 and the distributed
  optimizer, each from the same initial weights; a checkpoint saved mid-run in
  one layout resumed in another; the resume-exactness check; megatron-core's
  MoE layer at EP=2.
- `lancet` (4 ranks): --overlap-wgrad off, all-under-next-a2a and greedy in
  the layouts and settings of issue 14 (EP=2, TP=2+SP+EP=2 and PP=2+EP=2 with
  2 micro-batches, EP=2 with 4, EP=4 with the distributed optimizer,
  recompute, the arctic policy, bf16, fp16, a shared expert, a memory cap),
  the runs of a layout from the same seed.
- `gpu` (1 rank on a CUDA GPU, nccl): the reference's initial weights trained
  in fp32, in bf16 with the arctic policy and in fp16; resume exactness.
"""

import os
import sys

from tests.distributed.launcher import finish_job, train_in_job

SCENARIO, DATA, TOKENIZER, WORKDIR = sys.argv[1:5]
ITERS = 4

MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--eval-iters", "0",
    "--eval-interval", "0", "--log-interval", "1", "--data-path", DATA, "--tokenizer-model", TOKENIZER,
    "--split", "90,10,0", "--seed", "7", "--log-params-norm",
]  # fmt: skip
MCORE = ["--moe-layer-impl", "mcore"]  # megatron-core's MoE layer, the layer benchmark's reference

RECOMPUTE_ALL = [
    "--recompute-modules",
    "input_norm",
    "qkv",
    "core_attention",
    "attn_proj",
    "pre_mlp_norm",
    "router",
    "ordering",
    "expert_fc1",
    "expert_act",
    "expert_fc2",
    "unorder",
    "mlp_fc1",
    "mlp_act",
    "mlp_fc2",
]

LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "ep2": ["--expert-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "tp2_ep2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"],
    "ep4_distopt": ["--expert-model-parallel-size", "4", "--use-distributed-optimizer"],
    # Selective activation recompute changes nothing numerically, under TP+SP, EP and PP.
    "tp2_ep2_recompute": [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--expert-model-parallel-size",
        "2",
        *RECOMPUTE_ALL,
    ],
    "pp2_ep2_recompute": ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", *RECOMPUTE_ALL],
}
# Quantized activations change the backward only: the first loss is exact, the rest close.
ARCTIC = (
    "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --activation-policy arctic"
).split()


def train(*extra: str) -> list[dict]:
    """One run; every rank returns the logging rank's per-step figures."""
    return train_in_job([*MODEL, *extra])


def ckpt(name: str) -> str:
    return os.path.join(WORKDIR, name)


def reference() -> dict:
    train("--train-iters", "0", "--save", ckpt("init"))
    init = ["--train-iters", str(ITERS), "--load", ckpt("init")]
    train("--train-iters", "0", "--save", ckpt("mcore_init"), *MCORE)
    return {
        "reference": train(*init, "--save", ckpt("ref"), "--save-interval", "2"),
        # fp16 with dynamic loss scaling: a scale that fits, and one so large that the first steps overflow.
        "fp16": train(*init, "--fp16", "--initial-loss-scale", "4096"),
        "fp16_overflow": train(*init, "--fp16", "--initial-loss-scale", str(2.0**100), "--hysteresis", "1"),
        "mcore": train("--train-iters", str(ITERS), "--load", ckpt("mcore_init"), *MCORE),
        # No balancing loss is computed: none is logged (not a 0).
        "no_balancing": train("--train-iters", "1", "--moe-router-load-balancing-type", "none"),
        "expert_choice": train("--train-iters", "1", "--moe-gate", "expert_choice"),
        "ref_params_norm_from_checkpoint": params_norm_of_checkpoint(ckpt("ref")),
    }


def params_norm_of_checkpoint(path: str) -> float:
    """The L2 norm of a checkpoint's weights, loaded into one plain model (each parameter once)."""
    import torch
    from megatron.core import parallel_state

    from megatron_moe.checkpointing.hf_convert import load_single

    _, model, _ = load_single(path)
    norm = torch.sqrt(sum(p.detach().double().square().sum() for p in model.parameters())).item()
    parallel_state.destroy_model_parallel()
    return norm


def layouts() -> dict:
    init = ["--train-iters", str(ITERS), "--load", ckpt("init")]
    results = {name: train(*init, *args) for name, args in LAYOUTS.items()}
    results["tp2_pp2_arctic"] = train(*init, *ARCTIC)
    # Iteration 2 of the single-process run, resumed under other layouts (optimizer resharded).
    results["resume_ref_as_tp2_ep2"] = train(
        "--train-iters", str(ITERS), "--load", ckpt("ref/iter_0000002"), *LAYOUTS["tp2_ep2"]
    )
    # Distributed-optimizer state saved at iteration 2 under EP=4, resumed under PP=2.
    train(*init, *LAYOUTS["ep4_distopt"], "--exit-interval", "2", "--save", ckpt("distopt"))
    results["resume_ep4_distopt_as_pp2"] = train(
        "--train-iters", str(ITERS), "--load", ckpt("distopt"), *LAYOUTS["pp2"], "--use-distributed-optimizer"
    )
    # Resume exactness in one layout: 6 straight vs 3 + resume + 3 (EP=2, DP=4: per-rank RNG).
    ep = LAYOUTS["ep2"] + ["--hidden-dropout", "0.1"]
    results["straight"] = train("--train-iters", "6", *ep)
    train("--train-iters", "6", "--exit-interval", "3", "--save", ckpt("resume"), *ep)
    results["resumed"] = train("--train-iters", "6", "--load", ckpt("resume"), "--save", ckpt("resume"), *ep)
    results["mcore_ep2"] = train("--train-iters", str(ITERS), "--load", ckpt("mcore_init"), *MCORE, *LAYOUTS["ep2"])
    results["timeouts_default"] = process_group_timeouts()
    train("--train-iters", "1", "--distributed-timeout-minutes", "3", *LAYOUTS["ep2"])
    results["timeouts_after_3_minutes"] = process_group_timeouts()
    return results


def process_group_timeouts() -> list[float]:
    """The distinct timeouts (s) of every process group this process has: the default one and every group
    megatron-core's parallel state made (expert, data-parallel, gloo ones)."""
    import torch
    import torch.distributed as dist

    groups = dist.distributed_c10d._world.pg_map
    return sorted({pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() for pg in groups})


LANCET = {
    "ep2": LAYOUTS["ep2"],
    "tp2_ep2": LAYOUTS["tp2_ep2"],
    "pp2_ep2": ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
    "ep4_distopt": LAYOUTS["ep4_distopt"],
    "tp2_ep2_recompute": LAYOUTS["tp2_ep2_recompute"],
    "ep2_arctic": ["--expert-model-parallel-size", "2", "--activation-policy", "arctic"],
    "ep2_bf16": ["--expert-model-parallel-size", "2", "--bf16"],
    "ep2_shared": ["--expert-model-parallel-size", "2", "--moe-shared-expert-ffn-hidden-size", "64"],
    "ep2_fp16": ["--expert-model-parallel-size", "2", "--fp16", "--initial-loss-scale", "4096"],
    "ep2_accumulate": ["--expert-model-parallel-size", "2", "--global-batch-size", "32"],  # 4 micro-batches
    "ep2_untied": ["--expert-model-parallel-size", "2", "--untie-embeddings-and-output-weights"],  # LM head deferred
    # megatron-core's full recompute: each layer's backward is a nested (reentrant) one.
    "ep2_full_recompute": ["--expert-model-parallel-size", "2", "--recompute-granularity", "full"],
    # DDP's buckets start their reduce when their last gradient is in: deferred ones count when they run.
    "pp2_ep2_overlap_grad_reduce": ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    + ["--overlap-grad-reduce"],
}


def lancet() -> dict:
    """Each LANCET layout with the weight-gradient queue off and on; greedy (its plan in force from iteration 3)
    in two; a memory cap so small that some closures run at their natural place."""
    init = ["--train-iters", str(ITERS)]
    results = {}
    for name, args in LANCET.items():
        for policy in ("off", "all-under-next-a2a"):
            results[f"{name}/{policy}"] = train(*init, *args, "--overlap-wgrad", policy)
    for name in ("ep2", "tp2_ep2"):
        results[f"{name}/greedy"] = train(*init, *LANCET[name], "--overlap-wgrad", "greedy")
    capped = ("--overlap-wgrad", "all-under-next-a2a", "--overlap-wgrad-max-mb", "0.2")
    results["ep2/capped"] = train(*init, *LANCET["ep2"], *capped)
    return results


def gpu() -> dict:
    import torch
    import torch.distributed as dist

    init = ["--train-iters", str(ITERS), "--load", ckpt("init")]
    bf16 = ["--bf16", "--hidden-dropout", "0.1"]
    torch.cuda.reset_peak_memory_stats()
    fp32 = train(*init)
    results = {
        # What the run itself used: the process group's backend, and CUDA memory its model, optimizer and
        # activations took (a run that fell back to the host would allocate none).
        "backend": dist.get_backend(),
        "fp32_peak_cuda_bytes": torch.cuda.max_memory_allocated(),
        "fp32": fp32,
        "bf16_arctic": train(*init, "--bf16", "--activation-policy", "arctic"),
        "fp16": train(*init, "--fp16", "--initial-loss-scale", "4096"),
        "straight": train("--train-iters", "6", *bf16),
    }
    train("--train-iters", "6", "--exit-interval", "3", "--save", ckpt("gpu_resume"), *bf16)
    results["resumed"] = train("--train-iters", "6", "--load", ckpt("gpu_resume"), *bf16)
    return results


if __name__ == "__main__":
    finish_job({"reference": reference, "layouts": layouts, "lancet": lancet, "gpu": gpu}[SCENARIO]())
