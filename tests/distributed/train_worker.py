"""Shared jobs' parts (job_runner.py): many short training runs, results as JSON for pytest.

    argv: SCENARIO DATA_PREFIX TOKENIZER WORKDIR [TOKENIZER_RUNS_JSON]; the part's entry is the function SCENARIO

Scenarios (each a list of cases run one after another):
- `reference` (1 rank): save the initial weights, then train from them
  (fp32, and fp16 with a loss scale that fits and one that overflows; with an MTP layer);
  megatron-core's MoE layer (--moe-layer-impl mcore) likewise; one step each
  of runs that compute no balancing loss (what their log shows).
- `layouts` (4 ranks): TP=2, EP=2, PP=2 (even, and uneven by a layout string), TP=2+EP=2 and the distributed
  optimizer, each from the same initial weights; a checkpoint saved mid-run in
  one layout resumed in another; the resume-exactness check; megatron-core's
  MoE layer at EP=2; the interleaved pipeline (PP=2 x VPP=2, with EP=2, with the
  distributed optimizer and overlapped reduction and gather) and its checkpoints
  resumed at PP=1 and PP=2, and back; multi-token prediction at PP=2 x EP=2 from the reference's MTP weights,
  saved and resumed, at PP=2 x VPP=2 x EP=2 with the chunked pipeline and by a layout string, and at TP=2 + SP x
  EP=2 under the operator
  partition and Lancet's dW deferral.
- `lancet` (4 ranks): --overlap-wgrad off, all-under-next-a2a and greedy in
  Lancet's layouts and settings (EP=2, TP=2+SP+EP=2 and PP=2+EP=2 with
  2 micro-batches, EP=2 with 4, EP=4 with the distributed optimizer,
  recompute, the arctic policy, bf16, fp16, a shared expert, a memory cap, PP=2 x VPP=2 + EP=2),
  the runs of a layout from the same seed.
- `pipeline` (4 ranks): chunked dispatch -> experts -> combine at degrees (r_f, r_b) against
  (1, 1), from the same seed, in EP=2 (several degrees), SwiGLU with the capacity-padded all-to-all,
  TP=2+SP+EP=2, PP=2+EP=2, the arctic policy's quantized activations, 4 micro-batches, ESP=2 x EP=2 and
  TP=2+SP with ESP=2 x EP=2; and Lancet's all-under-next-a2a against off at the same degrees.
- `esp` (4 ranks): expert-sharded parallelism from the reference's
  initial weights: ESP=2 x EP=2, TP=2+SP with ESP=2 x EP=2, PP=2 x ESP=2,
  SwiGLU with the padded all-to-all (against the reference's SwiGLU run),
  the reference's iteration-2 checkpoint resumed at ESP=2 x EP=2, and an
  ESP=2 x EP=2 checkpoint resumed at EP=4 and at EP=1 x DP=4.
- `grad_reduce` (4 ranks): adaptive gradient partition against megatron-core's reduction, from the
  same seed: TP=2+SP+EP=2 (DP=2) alone, with Lancet's queue, with 4 micro-batches and with the distributed
  optimizer; EP=2 (DP=4); PP=2+EP=2.
- `megatron_lm` (4 ranks): Megatron-LM flags at EP=2: samples against iterations, WSD, the warm-up
  fraction, the router flags (ours and megatron-core's layer), --overlap-param-gather, the logging flags; the
  same corpus through each --tokenizer-type (TOKENIZER_RUNS_JSON: {type: its --data-path and tokenizer flags}),
  4 steps saved at 2, and resumed from step 2.
- `partition` (4 ranks): Lancet's operator partition (2 pieces of each micro-batch through every layer) against
  none, from the same seed, with every overlap on (Lancet's greedy dW queue, FSMoE's pipeline at 2 x 2, the
  adaptive gradient partition on a profile made slow, as `grad_reduce`): EP=2, EP=4, TP=2+SP+EP=2, PP=2+EP=2;
  PP=2 x VPP=2 + EP=2 with megatron-core's overlapped reduction; EP=2 with a shared expert and every module
  recomputed (pipeline degrees 1: the recomputed expert_fc2 keeps the pipeline off).
- `expert_bias` (4 ranks): aux-loss-free balancing with group-limited routing at EP=2 and EP=4 from the same
  seed, EP=2's step-2 checkpoint resumed at EP=4, the same run without the bias; the checkpoints' biases read at
  EP=1.
- `batch_overlap` (4 ranks): batch-level overlap (--overlap-moe-expert-parallel-comm) against none, from the same
  seed: EP=2, EP=4, TP=2+SP+EP=2, PP=2+EP=2 (the interleaved schedule with one chunk), PP=2 x VPP=2 + EP=2, EP=2 with
  DeepSeek-V3's parts (MLA, a dense first layer, a gated shared expert, MTP), and TP=2+SP+EP=2 with the adaptive
  gradient partition, FSMoE's pipeline and Lancet's queue on.
- `gpu` (1 rank on a CUDA GPU, nccl): the reference's initial weights trained
  in fp32, in bf16 with the arctic policy and in fp16; resume exactness.
"""

import dataclasses
import json
import logging
import os
import shutil
import sys

import torch.distributed as dist

from tests.distributed.launcher import finish_job, train_in_job
from tests.distributed.megatron_lm_configs import CPU_RUNS, cpu_argv

SCENARIO, DATA, TOKENIZER, WORKDIR = sys.argv[1:5]
TOKENIZER_RUNS = sys.argv[5] if len(sys.argv) > 5 else None
ITERS = 4

MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2", "--moe-aux-loss-coeff", "0.01",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1",
    "--eval-iters", "0", "--eval-interval", "0", "--log-interval", "1", "--data-path", DATA,
    "--tokenizer-model", TOKENIZER, "--split", "90,10,0", "--seed", "7", "--log-params-norm",
]  # fmt: skip
# megatron-core's MoE layer, the layer benchmark's reference (without biases: it has expert biases only at ESP 1)
MCORE = ["--moe-layer-impl", "mcore", "--disable-bias-linear"]
# Multi-token prediction, its MTP layer's MoE ours (--moe-layer-freq 1: the last layer, whose spec it takes, is MoE)
MTP = ["--mtp-num-layers", "1", "--moe-layer-freq", "1"]

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

# TP=2 + SP with the experts whole on each rank: unset, ESP follows TP (Megatron-LM's default, which "tp2" runs),
# and the expert DP that the EP layouts below are written for would halve.
TP2_WHOLE_EXPERTS = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "ep2": ["--expert-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    # Megatron-LM's other rank order: the stages on ranks (0, 1) and (2, 3), the DP replicas (0, 2) and (1, 3)
    "pp2_dp_last": ["--pipeline-model-parallel-size", "2", "--use-tp-pp-dp-mapping"],
    "tp2_ep2": [*TP2_WHOLE_EXPERTS, "--expert-model-parallel-size", "2"],
    "ep4_distopt": ["--expert-model-parallel-size", "4", "--use-distributed-optimizer"],
    # Megatron-LM's partial distributed optimizer: 2 instances of 2 DP ranks (expert DP 2: 2 of 1)
    "ep2_distopt_2instances": [
        "--expert-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--num-distributed-optimizer-instances",
        "2",
    ],
    # Selective activation recompute changes nothing numerically, under TP+SP, EP and PP.
    "tp2_ep2_recompute": [*TP2_WHOLE_EXPERTS, "--expert-model-parallel-size", "2", *RECOMPUTE_ALL],
    "pp2_ep2_recompute": ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", *RECOMPUTE_ALL],
    # Uneven stages (Megatron-LM's layout string): rank 0 the embedding and layers 1-3, rank 1 layer 4 and the loss
    "pp2_uneven_ep2": [
        "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*3|tL",
        "--expert-model-parallel-size", "2",
    ],
}  # fmt: skip
# megatron-core's interleaved 1F1B, 2 model chunks per pipeline rank (rank 0: layers 1 and 3, rank 1: 2 and
# 4); 4 ranks, so DP=2 and 2 micro-batches (a multiple of PP). Each Megatron-LM spelling of it once.
VPP2 = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
VPP_LAYOUTS = {
    "pp2_vpp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    "pp2_vpp2_ep2": [*VPP2, "--expert-model-parallel-size", "2"],
    # megatron-core's per-chunk grad_sync_func and the distributed optimizer's per-chunk param gather
    "pp2_vpp2_ep2_overlap_distopt": [*VPP2, "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                                     "--overlap-grad-reduce", "--overlap-param-gather"],
}  # fmt: skip
# Quantized activations change the backward only: the first loss is exact, the rest close.
ARCTIC = [*TP2_WHOLE_EXPERTS, *"--pipeline-model-parallel-size 2 --activation-policy arctic".split()]


SWIGLU_PADDED = ["--swiglu", "--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor", "1.5"]
ESP2_EP2 = ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2"]
ESP_LAYOUTS = {
    "esp2_ep2": ESP2_EP2,
    "tp2_esp2_ep2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", *ESP2_EP2],
    "pp2_esp2": ["--pipeline-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
    "esp2_ep2_distopt": [*ESP2_EP2, "--use-distributed-optimizer"],
}


MLA = (
    "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 32 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
    "--v-head-dim 16 --qk-layernorm --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707"
).split()
"""DeepSeek-V3's attention shrunk: q and kv latents with their norms, YaRN RoPE (issue 40)."""


TIMED_SCENARIOS = {"esp", "pipeline", "partition"}
"""The parts whose tests read the communication timers' figures of every run (the collectives each run issued);
the other parts' runs train with --no-comm-timers unless a run asks (`train(timed=True)`)."""


def train(*extra: str, model: list[str] = MODEL, timed: bool = False) -> list[dict]:
    """One run; every rank returns the logging rank's per-step figures.

    Our layer's runs pin the pipeline degrees to 1 and the gradient reduction to megatron-core's unless they say
    otherwise: auto's degrees and the adaptive partition come from timings measured at start-up, so two runs a
    test compares could differ in them (`pipeline` tests auto itself, `grad_reduce` the adaptive partition).
    The communication timers are on in `TIMED_SCENARIOS`, in a run that says `timed` or asks for --overlap-report
    (which reads them), and off elsewhere: they only observe (their arrival exchange, ~0.5 s a run at 4 ranks on
    2 cores with the start-up link probe), and the runs compared here are compared by their losses and norms."""
    ours = not any(a == "--moe-layer-impl" and b == "mcore" for a, b in zip(extra, extra[1:]))
    pinned = [*degrees(1, 1), "--grad-reduce-schedule", "megatron"] if ours else []
    timers = timed or SCENARIO in TIMED_SCENARIOS or "--overlap-report" in extra
    return train_in_job([*model, *pinned, *([] if timers else ["--no-comm-timers"]), *extra])


def ckpt(name: str) -> str:
    return os.path.join(WORKDIR, name)


def reference() -> dict:
    train("--train-iters", "0", "--save", ckpt("init"))
    init = ["--train-iters", str(ITERS), "--load", ckpt("init")]
    train("--train-iters", "0", "--save", ckpt("mcore_init"), *MCORE)
    train("--train-iters", "0", "--save", ckpt("swiglu_init"), *SWIGLU_PADDED)
    train("--train-iters", "0", "--save", ckpt("mtp_init"), *MTP)
    return {
        "mtp": train("--train-iters", str(ITERS), "--load", ckpt("mtp_init"), *MTP),
        "reference": train(*init, "--save", ckpt("ref"), "--save-interval", "2"),
        "swiglu_padded": train("--train-iters", str(ITERS), "--load", ckpt("swiglu_init"), *SWIGLU_PADDED),
        # fp16 with dynamic loss scaling: a scale that fits, and one so large that the first steps overflow.
        "fp16": train(*init, "--fp16", "--initial-loss-scale", "4096"),
        "fp16_overflow": train(*init, "--fp16", "--initial-loss-scale", str(2.0**100), "--hysteresis", "1"),
        "mcore": train("--train-iters", str(ITERS), "--load", ckpt("mcore_init"), *MCORE),
        # No balancing loss is computed: none is logged (not a 0).
        "no_balancing": train("--train-iters", "1", "--moe-router-load-balancing-type", "none"),
        "expert_choice": train("--train-iters", "1", "--moe-gate", "expert_choice"),
        "ref_params_norm_from_checkpoint": params_norm_of_checkpoint(ckpt("ref")),
    } | mla_reference()


def mla_reference() -> dict:
    """The MLA model in one process from its saved initial weights, saving at step 2 (`mla_layouts` resumes it)."""
    train("--train-iters", "0", "--save", ckpt("mla_init"), *MLA)
    init = ["--train-iters", str(ITERS), "--load", ckpt("mla_init")]
    return {"mla": train(*init, *MLA, "--save", ckpt("mla"), "--save-interval", "2")}


def mla_layouts() -> dict:
    """The MLA model at TP=2 + SP x EP=2 (Lancet's greedy dW deferral on by default at EP > 1), from the single-
    process run's initial weights; and its step-2 checkpoint resumed there recomputing the attention's modules."""
    tp2_ep2 = [*MLA, *LAYOUTS["tp2_ep2"]]
    recompute = ["--recompute-granularity", "selective", "--recompute-modules", "qkv", "core_attention", "attn_proj"]
    return {
        "mla_tp2_ep2": train("--train-iters", str(ITERS), "--load", ckpt("mla_init"), *tp2_ep2),
        "mla_resume_as_tp2_ep2_recompute": train(
            "--train-iters", str(ITERS), "--load", ckpt("mla/iter_0000002"), *tp2_ep2, *recompute
        ),
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
    results = {name: train(*init, *args, timed=True) for name, args in LAYOUTS.items()}  # TP call counts read
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
    results["resume_ep4_distopt_as_2instances"] = train(
        "--train-iters", str(ITERS), "--load", ckpt("distopt"), *LAYOUTS["ep2_distopt_2instances"]
    )
    # Resume exactness in one layout: 6 straight vs 3 + resume + 3 (EP=2, DP=4: per-rank RNG).
    ep = LAYOUTS["ep2"] + ["--hidden-dropout", "0.1"]
    results["straight"] = train("--train-iters", "6", *ep)
    train("--train-iters", "6", "--exit-interval", "3", "--save", ckpt("resume"), *ep)
    results["resumed"] = train("--train-iters", "6", "--load", ckpt("resume"), "--save", ckpt("resume"), *ep)
    results |= virtual_pipeline(init)
    # MTP at PP=2 x EP=2 (the MTP layer on the last stage, its embedding copy tied to the first's) from the
    # single-process run's initial weights, saved at 2 and resumed there.
    mtp = ["--train-iters", str(ITERS), *MTP, *LAYOUTS["pp2_ep2_recompute"][:4]]
    results["mtp_pp2_ep2"] = train(*mtp, "--load", ckpt("mtp_init"), "--save", ckpt("mtp"), "--save-interval", "2")
    results["mtp_pp2_ep2_resumed"] = train(*mtp, "--load", ckpt("mtp/iter_0000002"))
    # ... and at TP=2 + SP x EP=2 under Lancet's operator partition and dW deferral.
    overlaps = ["--moe-partition-pieces", "2", "--moe-partition-range", "1-4", "--overlap-wgrad", "all-under-next-a2a"]
    # ... and on the last virtual stage of PP=2 x VPP=2 x EP=2, FSMoE's chunked pipeline on, shadowing auto.
    chunked = [*degrees(2, 2), "--moe-shadow-experts", "auto"]
    results["mtp_pp2_vpp2_ep2_chunked"] = train(
        "--train-iters", str(ITERS), *MTP, "--load", ckpt("mtp_init"), *VPP_LAYOUTS["pp2_vpp2_ep2"], *chunked
    )
    # ... and placed by a layout string: PP=2 x 2 chunks, the MTP layer with the loss on rank 1's second chunk
    results["mtp_pp2_vpp2_layout"] = train(
        "--train-iters",
        str(ITERS),
        *MTP,
        "--load",
        ckpt("mtp_init"),
        "--pipeline-model-parallel-size",
        "2",
        "--pipeline-model-parallel-layout",
        "Et|t|t|tmL",
        *LAYOUTS["ep2"],
    )
    results["mtp_tp2_ep2_overlaps"] = train(
        "--train-iters", str(ITERS), *MTP, "--load", ckpt("mtp_init"), *LAYOUTS["tp2_ep2"], *overlaps
    )
    results["mcore_ep2"] = train("--train-iters", str(ITERS), "--load", ckpt("mcore_init"), *MCORE, *LAYOUTS["ep2"])
    # ESP unset at TP=2: megatron-core's expert TP over 2 ranks (Megatron-LM's default)
    results["mcore_tp2"] = train("--train-iters", str(ITERS), "--load", ckpt("mcore_init"), *MCORE, *LAYOUTS["tp2"])
    results["timeouts_default"] = timeouts_of_a_run(*LAYOUTS["ep2"])
    results["timeouts_3_minutes"] = timeouts_of_a_run("--distributed-timeout-minutes", "3", *LAYOUTS["ep2"])
    # Read by one plain model; after the timeouts are taken (its parallel state has megatron-core's own timeout).
    results["vpp_params_norm_from_checkpoint"] = params_norm_of_checkpoint(ckpt("vpp"))
    return results | mla_layouts() | muon_runs(init)


MUON = {
    "muon": ["--optimizer", "muon"],
    # Muon's layer-wise distributed optimizer (megatron-core 0.16.1 saves it in bf16 only)
    "muon_layer_wise": ["--optimizer", "muon", "--use-distributed-optimizer", "--bf16"],
}


def muon_runs(init: list[str]) -> dict:
    """--optimizer muon at EP=2 (dense DP 4, expert DP 2) from the reference's initial weights, saved at step 2 and
    resumed from there; the same with Muon's layer-wise distributed optimizer; and emerging_optimizers' TP
    Newton-Schulz (the stand-in) over the 4 ranks against the unsharded one."""
    results = {}
    for name, flags in MUON.items():
        results[f"{name}_ep2"] = train(*init, *LAYOUTS["ep2"], *flags, "--save", ckpt(name), "--save-interval", "2")
        results[f"{name}_ep2_resumed"] = train(
            "--train-iters", str(ITERS), "--load", ckpt(f"{name}/iter_0000002"), *LAYOUTS["ep2"], *flags
        )
    return results | {"muon_tp_modes": newton_schulz_tp_errors()}


def newton_schulz_tp_errors() -> dict:
    """Per TP mode and sharded dimension, the largest difference (over the ranks) between a rank's slice of the
    orthogonalized whole matrix and what `newton_schulz_tp` gives it from its shard."""
    import torch
    import torch.distributed as dist

    from megatron_moe.platform import emerging_optimizers as eo

    group, size, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(5))
    errors = {}
    with eo.fp32_matmul_precision("highest"):
        whole = eo.newton_schulz(x, steps=5)
        for dim in (0, 1):
            shard = x.chunk(size, dim=dim)[rank].contiguous()
            for mode in ("duplicated", "distributed"):
                mine = eo.newton_schulz_tp(shard, 5, "quintic", group, partition_dim=dim, mode=mode)
                error = (mine - whole.chunk(size, dim=dim)[rank]).abs().max()
                dist.all_reduce(error, op=dist.ReduceOp.MAX)
                errors[f"{mode}_{dim}"] = error.item()
    return errors


def virtual_pipeline(init: list[str]) -> dict:
    """The VPP_LAYOUTS from the reference's initial weights; a checkpoint saved at PP=2 x VPP=2 x EP=2 mid-run
    resumed at PP=1 (DP=4) and at PP=2 without virtual stages; the single-process run's iteration 2 resumed at
    PP=2 x VPP=2 x EP=2 (optimizer state resharded across chunks each way)."""
    results = {name: train(*init, *args) for name, args in VPP_LAYOUTS.items()}
    train(*init, *VPP_LAYOUTS["pp2_vpp2_ep2"], "--exit-interval", "2", "--save", ckpt("vpp"))
    resume = ["--train-iters", str(ITERS), "--load", ckpt("vpp")]
    results["resume_vpp2_as_pp1"] = train(*resume)
    results["resume_vpp2_as_pp2"] = train(*resume, "--pipeline-model-parallel-size", "2")
    results["resume_ref_as_pp2_vpp2_ep2"] = train(
        "--train-iters", str(ITERS), "--load", ckpt("ref/iter_0000002"), *VPP_LAYOUTS["pp2_vpp2_ep2"]
    )
    return results


def timeouts_of_a_run(*flags: str) -> list[float]:
    """The distinct timeouts (s) of every process group a one-step run has, read at its shutdown (which then
    destroys all but the default one): the default group and every group megatron-core's parallel state made
    (expert, data-parallel, gloo ones)."""
    from unittest import mock

    import torch
    import torch.distributed as dist

    import megatron_moe.training as training

    seen = []

    def shutdown(**kwargs):
        groups = dist.distributed_c10d._world.pg_map
        seen.extend({pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() for pg in groups})
        shutdown_run(**kwargs)

    shutdown_run = training.shutdown
    with mock.patch.object(training, "shutdown", shutdown):
        train("--train-iters", "1", *flags)
    return sorted(set(seen))


def esp() -> dict:
    """Each ESP layout from the reference's initial weights; checkpoints across ESP and EP sizes."""
    init = ["--train-iters", str(ITERS), "--load", ckpt("init")]
    results = {name: train(*init, *args) for name, args in ESP_LAYOUTS.items()}
    swiglu = ["--train-iters", str(ITERS), "--load", ckpt("swiglu_init"), *SWIGLU_PADDED]
    results["esp2_ep2_swiglu_padded"] = train(*swiglu, *ESP2_EP2)
    # The single-process run's iteration 2 (optimizer state included) resumed at ESP=2 x EP=2.
    from_ref = ["--train-iters", str(ITERS), "--load", ckpt("ref/iter_0000002")]
    results["resume_ref_as_esp2_ep2"] = train(*from_ref, *ESP2_EP2)
    # Saved at ESP=2 x EP=2 (distributed optimizer) at iteration 2, resumed at EP=4 and at EP=1 (DP=4).
    train(*init, *ESP_LAYOUTS["esp2_ep2_distopt"], "--exit-interval", "2", "--save", ckpt("esp_distopt"))
    for name, args in (("ep4", ["--expert-model-parallel-size", "4"]), ("ep1", [])):
        resumed = ["--train-iters", str(ITERS), "--load", ckpt("esp_distopt"), "--use-distributed-optimizer"]
        results[f"resume_esp2_ep2_as_{name}"] = train(*resumed, *args)
    return results


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
    # ESP: experts sharded over ESP=2 (their dW slices deferred under the all-to-alls between ESP groups).
    "esp2_ep2": ESP2_EP2,
    # The interleaved pipeline, each chunk's backward a pass of its own (and the queue's flush at its end);
    # every layer MoE, so that the logging rank's chunks (layers 2 and 4) have all-to-alls to hide dW under.
    "pp2_vpp2_ep2": [*VPP2, "--expert-model-parallel-size", "2", "--moe-layer-freq", "1"],
}


def lancet() -> dict:
    """Each LANCET layout with the weight-gradient queue off and on; greedy (its plan in force from iteration 3)
    in two; a memory cap so small that some closures run at their natural place."""
    init = ["--train-iters", str(ITERS)]
    results = {}
    for name, args in LANCET.items():
        for policy in ("off", "all-under-next-a2a"):
            results[f"{name}/{policy}"] = train(*init, *args, "--overlap-wgrad", policy)
    for name in ("ep2", "tp2_ep2", "pp2_vpp2_ep2"):
        results[f"{name}/greedy"] = train(*init, *LANCET[name], "--overlap-wgrad", "greedy")
    capped = ("--overlap-wgrad", "all-under-next-a2a", "--overlap-wgrad-max-mb", "0.2")
    results["ep2/capped"] = train(*init, *LANCET["ep2"], *capped)
    return results


EP2 = ["--expert-model-parallel-size", "2", "--overlap-wgrad", "off"]
PIPELINE = {
    "ep2": EP2,
    "ep2_swiglu_padded": [*EP2, "--swiglu", "--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor", "1"],
    "tp2_ep2": [*LAYOUTS["tp2_ep2"], "--overlap-wgrad", "off"],
    "pp2_ep2": ["--pipeline-model-parallel-size", "2", *EP2],
    "ep2_arctic": [*EP2, "--activation-policy", "arctic"],
    "ep2_accumulate": [*EP2, "--global-batch-size", "32"],  # 4 micro-batches
    "esp2_ep2": [*ESP2_EP2, "--overlap-wgrad", "off"],
    "tp2_esp2_ep2": [*ESP2_EP2, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--overlap-wgrad", "off"],
}


def degrees(forward: int | str, backward: int | str) -> list[str]:
    return ["--moe-pipeline-degree", str(forward), "--moe-bp-pipeline-degree", str(backward)]


def pipeline() -> dict:
    """Each PIPELINE layout unpipelined and at 3 x 2; EP=2 at more degrees; Lancet's queue on and off at 3 x 2."""
    init = ["--train-iters", str(ITERS)]
    results = {}
    for name, args in PIPELINE.items():
        for forward, backward in ((1, 1), (3, 2)):
            results[f"{name}/{forward}x{backward}"] = train(*init, *args, *degrees(forward, backward))
    for forward, backward in ((2, 2), (4, 1), (1, 4)):
        results[f"ep2/{forward}x{backward}"] = train(*init, *EP2, *degrees(forward, backward))
    lancet = ["--expert-model-parallel-size", "2", "--overlap-wgrad", "all-under-next-a2a"]
    results["ep2_lancet/3x2"] = train(*init, *lancet, *degrees(3, 2))
    results |= pipeline_auto()
    return results


TRUSTED_PROFILE = ["--cost-profile-min-r2", "0"]
"""Every line of a measured profile used, whatever its scatter: these runs test what is planned from a profile
(and edit its all-reduce line), and on this host's shared cores a line may scatter enough to be left unused
(tests/unit/test_cost_profile_cache.py tests that check)."""


def pipeline_auto() -> dict:
    """auto: the cost model's degrees, from one profile cached per cluster fingerprint (--cost-profile-cache; every
    line trusted, so that the outcome does not hang on this host's noise: the check has unit tests). A run whose
    every rank fails at the start of its first iteration leaves no profile; the next run measures it and writes
    it after its first iteration; the one after reuses it. Both report the degrees the solver gives for the cached
    fits (what the layers must have run: the test counts their all-to-alls), and their start-up lines."""
    from megatron_moe.config import parse_args
    from megatron_moe.overlap.cost_model import ClusterFits
    from megatron_moe.overlap.degrees import plan_degrees
    from megatron_moe.training.initialize import shutdown
    from megatron_moe.training.loop import RAISE_AT_ENV

    cache = ckpt("profile_cache")
    auto = ["--train-iters", str(ITERS), *EP2, "--moe-pipeline-degree", "auto", "--moe-bp-pipeline-degree", "auto"]
    auto += ["--cost-profile-cache", cache, *TRUSTED_PROFILE]
    os.environ[RAISE_AT_ENV] = f"{dist.get_rank()}:1"
    try:
        train(*auto)
        failed = False
    except RuntimeError:
        failed = True
        shutdown(destroy_process_group=False)
    finally:
        del os.environ[RAISE_AT_ENV]
    results = {"ep2_auto_failed": {"failed": failed, "files": sorted(os.listdir(cache))}}
    lines = StartupLines()
    results["ep2_auto"] = train(*auto)
    files = sorted(name for name in os.listdir(cache) if name.endswith(".json"))
    profile = os.path.join(cache, files[0])
    written = os.stat(profile).st_mtime_ns
    results["ep2_auto_loaded"] = train(*auto)
    results["ep2_auto_cache"] = {"files": files, "rewritten": os.stat(profile).st_mtime_ns != written}
    results["ep2_auto_lines"] = lines.detach()
    cfg = parse_args([*MODEL, *auto])
    schedule = next(iter(plan_degrees(cfg, ClusterFits.load(profile)).values()))
    results["ep2_auto_schedule"] = schedule.to_json()
    return results


class StartupLines(logging.Handler):
    """The cost model's start-up lines (training/cost_profile.py, rank 0) while it is attached."""

    def __init__(self):
        super().__init__()
        self.lines = []
        self.logger = logging.getLogger("megatron_moe.training.cost_profile")
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)  # the worker configures no logging: the root's WARNING would drop them
        self.logger.addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())

    def detach(self) -> list[str]:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)
        return self.lines


GRAD_REDUCE = {
    # DP=2 for the dense and the expert parameters: a sum of two is the same in any order, so bit-identical
    "tp2_ep2": [*LAYOUTS["tp2_ep2"], "--overlap-wgrad", "off"],
    "tp2_ep2_lancet": [*LAYOUTS["tp2_ep2"], "--overlap-wgrad", "all-under-next-a2a"],
    "tp2_ep2_accumulate": [*LAYOUTS["tp2_ep2"], "--overlap-wgrad", "off", "--global-batch-size", "32"],
    "tp2_ep2_distopt": [*LAYOUTS["tp2_ep2"], "--overlap-wgrad", "off", "--use-distributed-optimizer"],
    # DP=4 dense (ring order depends on the buckets), expert-DP=2; PP=2 with the plan on its first stage
    "ep2": EP2,
    "pp2_ep2": ["--pipeline-model-parallel-size", "2", *EP2],
}


def slow_link_profile(path: str, kind: str = "ar", alpha: float = 0.05, beta: float = 2.5e-6) -> None:
    """Replace the measured `kind` line of the profile at `path` (by default the all-reduce's, by a slow link's:
    0.05 ms + 0.4 GB/s). On loopback an all-reduce's start-up dwarfs its bytes, and the plan rightly keeps every
    byte for one reduction after backward: it would launch nothing from the MoE layers, and the runs would not test
    the launching."""
    from megatron_moe.overlap.cost_model import ClusterFits, LinearFit

    if dist.get_rank() == 0:
        fits = ClusterFits.load(path)
        dataclasses.replace(fits, fits={**fits.fits, kind: LinearFit(alpha=alpha, beta=beta)}).save(path)
    dist.barrier()


def grad_reduce() -> dict:
    """Each GRAD_REDUCE layout with megatron-core's reduction and the adaptive partition (FSMoE). Per
    layout a run of no steps measures the cluster's profile, whose all-reduce line becomes a slow link's
    (`slow_link_profile`); both runs load it."""
    init = ["--train-iters", str(ITERS)]
    results = {}
    for name, args in GRAD_REDUCE.items():
        path = os.path.join(WORKDIR, f"grad_reduce_{name}.json")
        profile = ["--moe-cost-profile", path, *TRUSTED_PROFILE]
        train("--train-iters", "0", *args, *profile, "--grad-reduce-schedule", "adaptive")
        slow_link_profile(path)
        for schedule in ("megatron", "adaptive"):
            results[f"{name}/{schedule}"] = train(*init, *args, *profile, "--grad-reduce-schedule", schedule)
    return results


BATCH_FLAG = "--overlap-moe-expert-parallel-comm"
BATCH = {  # layout -> flags, 2-4 micro-batches a step (a global batch of 16 or 32 sequences)
    "ep2": ["--expert-model-parallel-size", "2", "--global-batch-size", "32"],
    "ep4": ["--expert-model-parallel-size", "4", "--global-batch-size", "16"],
    "tp2_ep2": [*LAYOUTS["tp2_ep2"], "--global-batch-size", "16"],
    "pp2_ep2": ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                "--global-batch-size", "16"],
    "pp2_vpp2_ep2": [*VPP2, "--expert-model-parallel-size", "2", "--moe-layer-freq", "1", "--global-batch-size", "16"],
    # DeepSeek-V3's parts: MLA with qk-norm, a dense first layer, 8 experts top-4 with a gated shared expert, MTP
    "ep2_deepseek": [*MLA, "--expert-model-parallel-size", "2", "--global-batch-size", "16", "--num-experts", "8",
                     "--moe-router-topk", "4", "--moe-layer-freq", "([0]+[1]*3)", "--moe-shared-expert-ffn-hidden-size",
                     "64", "--moe-shared-expert-gate", "--mtp-num-layers", "1"],
}  # fmt: skip
BATCH_ALL_ON = ["--grad-reduce-schedule", "adaptive", *degrees(2, 2), "--delay-wgrad-compute"]
"""tp2_ep2_all_on: the adaptive gradient partition (on a profile made slow), FSMoE's pipeline at 2 x 2 and Lancet's
greedy queue (--delay-wgrad-compute: Megatron-LM's name for it) beside batch-level overlap."""


def batch_overlap() -> dict:
    """Each BATCH layout, and TP=2+SP+EP=2 with every other overlap on, without and with batch-level overlap from the
    same seed: per run its history and this rank's pairings (`moe.handover.COUNTS`: forward-backward pairs, forward
    stages run under a backward all-to-all); PP=2+EP=2 with it, saved at step 2 and resumed."""
    from megatron_moe.moe import handover

    path = os.path.join(WORKDIR, "batch_all_on.json")
    all_on = [*LAYOUTS["tp2_ep2"], "--global-batch-size", "16", "--moe-cost-profile", path, *TRUSTED_PROFILE]
    train("--train-iters", "0", *all_on, "--grad-reduce-schedule", "adaptive")
    slow_link_profile(path)
    results = {}
    for name, args in {**BATCH, "tp2_ep2_all_on": [*all_on, *BATCH_ALL_ON]}.items():
        for setting in ("off", "on"):
            before = dict(handover.COUNTS)
            flags = [*args, BATCH_FLAG] if setting == "on" else [a for a in args if a != "--delay-wgrad-compute"]
            history = train("--train-iters", "3", *flags)
            counts = {key: handover.COUNTS[key] - before[key] for key in before}
            results[f"{name}/{setting}"] = {"history": history, "counts": counts}
    # PP=2+EP=2 (the one-chunk interleaved schedule) saved at step 2 and resumed, overlap on: its step 3
    pp2 = [*BATCH["pp2_ep2"], BATCH_FLAG, "--train-iters", "3"]
    train(*pp2, "--exit-interval", "2", "--save", ckpt("batch_pp2"))
    results["pp2_ep2/resumed"] = {"history": train(*pp2, "--load", ckpt("batch_pp2"))}
    return results | overlap_choice()


CHOICE = ["--expert-model-parallel-size", "2", "--global-batch-size", "16", "--grad-reduce-schedule", "megatron"]
CHOICE_AUTO = ["--moe-overlap-choice", "auto", *degrees("auto", "auto")]
CHOICE_FREE = {"a2a", "ag", "rs", "ar", "chunk", "chunk_bwd", "unchunked", "unchunked_bwd"}
CHOICE_LINKS = {"slow": ({"a2a"}, 0.5, 1e-4), "free": (CHOICE_FREE, 0.0, 0.0)}
"""The lines set in the overlap choice's profile, to alpha and beta: a slow all-to-all (0.5 ms + 10 MB/s: the
pair hides much of it), or every collective and the pipeline's overhead free (nothing to hide: every feature is
predicted to gain nothing). A measured line left in can predict a gain: CI's all-reduce did for Lancet's queue, and
the overhead lines, the measured time beyond the model fitted against the measured all-to-all line, did for the
pipeline (r = 1's larger than r = 2's once the all-to-all they were fitted against is gone)."""


def overlap_choice() -> dict:
    """--moe-overlap-choice auto at EP=2 with 2 micro-batches a step, on a measured profile (its dense lines too)
    whose all-to-all line is each of CHOICE_LINKS': the choice's run, and the run of the flags it chose typed (per
    run its history and pairings, `moe.handover.COUNTS`; the chosen run's start-up figures carry the choice)."""
    from megatron_moe.moe import handover

    results = {}
    measured = os.path.join(WORKDIR, "choice.json")  # measured once, its all-to-all line set per link
    train("--train-iters", "0", *CHOICE, "--moe-cost-profile", measured, *TRUSTED_PROFILE, *CHOICE_AUTO)
    for link, (kinds, alpha, beta) in CHOICE_LINKS.items():
        path = os.path.join(WORKDIR, f"choice_{link}.json")
        profile = ["--moe-cost-profile", path, *TRUSTED_PROFILE]
        if dist.get_rank() == 0:
            shutil.copyfile(measured, path)
        for kind in sorted(kinds):
            slow_link_profile(path, kind, alpha, beta)  # its barrier: the copy is there for every rank
        before = dict(handover.COUNTS)
        chosen = train("--train-iters", "3", *CHOICE, *profile, *CHOICE_AUTO)
        counts = {key: handover.COUNTS[key] - before[key] for key in before}
        on = chosen[0]["startup"]["overlap_choice"]["on"]
        typed = [*([BATCH_FLAG] if "batch" in on else []), "--overlap-wgrad", "greedy" if "wgrad" in on else "off"]
        typed += degrees("auto", "auto") if "pipeline" in on else []  # else the launcher's 1 / 1
        results[f"choice/{link}/auto"] = {"history": chosen, "counts": counts}
        results[f"choice/{link}/typed"] = {"history": train("--train-iters", "3", *CHOICE, *profile, *typed)}
    return results


ALL_ON = ["--overlap-wgrad", "greedy", *degrees(2, 2)]
PARTITION = {
    "ep2": ["--expert-model-parallel-size", "2"],
    "ep4": ["--expert-model-parallel-size", "4"],
    "tp2_ep2": LAYOUTS["tp2_ep2"],
    "pp2_ep2": ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
}
PARTITION_MEGATRON_REDUCE = {
    "pp2_vpp2_ep2": [*VPP2, "--expert-model-parallel-size", "2", "--overlap-grad-reduce"],
    # expert_fc2 recomputed: the pipeline runs r = 1 (MoELayer.pipeline_degrees)
    "ep2_shared_recompute": ["--expert-model-parallel-size", "2", "--moe-shared-expert-ffn-hidden-size", "64",
                             *RECOMPUTE_ALL, *degrees(1, 1)],
}  # fmt: skip


def partition_flags(pieces: str) -> list[str]:
    """`pieces` pieces through every layer (not the planner's choice); the pieces' runs with --overlap-report."""
    report = ["--overlap-report"] if pieces != "1" else []
    return ["--moe-partition-pieces", pieces, "--moe-partition-range", "all", *report]


def partition() -> dict:
    """Each PARTITION layout with every overlap on, in 1 and 2 pieces (the adaptive partition on a profile measured
    once per layout and made slow, `slow_link_profile`); PARTITION_MEGATRON_REDUCE's likewise with megatron-core's
    reduction."""
    init = ["--train-iters", str(ITERS), *ALL_ON]
    results = {}
    for name, args in PARTITION.items():
        path = os.path.join(WORKDIR, f"partition_{name}.json")
        adaptive = ["--moe-cost-profile", path, *TRUSTED_PROFILE, "--grad-reduce-schedule", "adaptive"]
        train("--train-iters", "0", *args, *adaptive)
        slow_link_profile(path)
        for pieces in ("1", "2"):
            results[f"{name}/{pieces}"] = train(*init, *args, *adaptive, *partition_flags(pieces))
    for name, args in PARTITION_MEGATRON_REDUCE.items():
        for pieces in ("1", "2"):
            results[f"{name}/{pieces}"] = train(*init, *args, *partition_flags(pieces))
    return results


def without(flags: list[str], name: str) -> list[str]:
    """`flags` less `name` and its value."""
    i = flags.index(name)
    return flags[:i] + flags[i + 2 :]


def megatron_lm() -> dict:
    """Megatron-LM flags at EP=2 (DP=4), each group parsed and run: the run's length and schedule in
    samples against the same in iterations, WSD and the warm-up fraction; the router flags of our layer and of
    megatron-core's; --overlap-param-gather against the distributed optimizer without it (a save and an evaluation
    in between); the logging flags with TensorBoard."""
    model = without(MODEL, "--lr-warmup-iters")  # each run says how it warms up, in iterations or in samples
    base, iters = EP2, ["--train-iters", str(ITERS)]
    capacity = ["--moe-expert-capacity-factor", "1.0"]

    def run(*flags: str, timed: bool = False) -> list[dict]:
        return train(*flags, model=model, timed=timed)

    distopt = [*iters, "--use-distributed-optimizer", "--eval-interval", "2", "--eval-iters", "1"]
    results = {
        "iters": run(*base, *iters, "--lr-warmup-iters", "1", "--lr-decay-iters", "3"),
        "tp2_ep2": run(*base, *iters, "--tensor-model-parallel-size", "2", "--sequence-parallel"),
        "samples": run(*base, "--train-samples", "32", "--lr-warmup-samples", "8", "--lr-decay-samples", "24"),
        "wsd": run(*base, *iters, "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2", "--lr-wsd-decay-style",
                     "linear"),
        "fraction": run(*base, *iters, "--lr-warmup-fraction", "0.25"),
        "gate_sigmoid": run(*base, *iters, "--moe-gate", "sigmoid"),
        "score_sigmoid": run(*base, *iters, "--moe-router-score-function", "sigmoid"),
        "pre_softmax": run(*base, *iters, "--moe-router-pre-softmax"),
        "no_normalize": run(*base, *iters, "--no-moe-normalize-topk"),
        "scaled_probs": run(*base, *iters, *capacity, "--moe-router-topk-scaling-factor", "2",
                              "--moe-token-drop-policy", "probs"),
        "position": run(*base, *iters, *capacity, "--moe-token-drop-policy", "position"),
        "mcore": run(*without(base, "--overlap-wgrad"), *iters, *MCORE, *capacity, "--moe-router-pre-softmax",
                       "--moe-router-topk-scaling-factor", "2", "--moe-token-drop-policy", "position"),
        # Megatron-LM's spellings (renamed, and not needed with these values) against ours
        "megatron_lm_spelling": run(*base, *iters, "--moe-shared-expert-intermediate-size", "32",
                                    "--recompute-activations", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
                                    "--use-rotary-position-embeddings", "--rotary-percent", "1.0",
                                    "--group-query-attention", "--moe-shared-expert-overlap"),
        "our_spelling": run(*base, *iters, "--moe-shared-expert-ffn-hidden-size", "32", "--recompute-granularity",
                            "selective", "--recompute-modules", "core_attention"),
        "distopt": run(*base, *distopt, "--save", ckpt("distopt")),
        "param_gather": run(*base, *distopt, "--overlap-param-gather", "--save", ckpt("param_gather")),
        "logging": run(*base, *iters, "--log-throughput", "--log-num-zeros-in-grad", "--tensorboard-dir",
                         os.path.join(WORKDIR, "tb"), "--tensorboard-log-interval", "2",
                         "--log-validation-ppl-to-tensorboard", "--eval-interval", "2", "--eval-iters", "1",
                         timed=True),  # its comm/ tags
    }  # fmt: skip
    results["distopt_params_norm"] = params_norm_of_checkpoint(ckpt("distopt"))
    results["param_gather_params_norm"] = params_norm_of_checkpoint(ckpt("param_gather"))
    results.update(tokenizer_runs(base, iters))
    for name in CPU_RUNS:  # Megatron-LM's own MoE test configs, degrees as written, shrunk for a CPU
        results[f"config:{name}"] = train_in_job(cpu_argv(name))
    return results


GROUP_LIMITED = ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"]
SIGMOID = ["--train-iters", str(ITERS), "--moe-router-score-function", "sigmoid", *GROUP_LIMITED]
BIAS = [*SIGMOID, "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01"]


def expert_biases_of_checkpoint(path: str) -> list[list[float]]:
    """Each MoE layer's expert bias in a checkpoint, loaded into one plain model (EP=1)."""
    from megatron.core import parallel_state

    from megatron_moe.checkpointing.hf_convert import load_single

    _, model, _ = load_single(path)
    biases = [m.expert_bias.tolist() for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    parallel_state.destroy_model_parallel()
    return biases


def expert_bias() -> dict:
    """Aux-loss-free balancing with group-limited routing (sigmoid scores, 2 groups of 2 experts, 1 per token) at
    EP=2 and EP=4 (DP=4 both) from the same seed, saved at step 2 and 4; EP=2's step-2 checkpoint resumed at EP=4;
    the same sigmoid run without the bias; each checkpoint's biases read back at EP=1."""
    ep2, ep4 = (["--expert-model-parallel-size", n, "--overlap-wgrad", "off"] for n in ("2", "4"))
    results = {
        "ep2": train(*BIAS, *ep2, "--save", ckpt("bias_ep2"), "--save-interval", "2"),
        "ep4": train(*BIAS, *ep4, "--save", ckpt("bias_ep4")),
        "ep2_no_bias": train(*SIGMOID, *ep2),
        "resumed_ep4": train(*BIAS, *ep4, "--load", ckpt("bias_ep2/iter_0000002"), "--save", ckpt("bias_resumed")),
    }
    for name in ("bias_ep2", "bias_ep4", "bias_resumed"):
        results[f"{name}/biases"] = expert_biases_of_checkpoint(ckpt(name))
    results["bias_ep2_step2/biases"] = expert_biases_of_checkpoint(ckpt("bias_ep2/iter_0000002"))
    return results | shadow_runs()


def shadow_runs() -> dict:
    """FasterMoE's shadow experts in training (in `expert_bias`'s job): EP=2 (DP=2 over the experts) and EP=4 with
    Lancet's greedy dW plan (in force from step 3) and the chunked pipeline (2 / 2), without and with 2 and 1
    experts shadowed; and --moe-shadow-experts auto on the cost model's profile (measured at start-up)."""
    overlap = ["--train-iters", str(ITERS), "--overlap-wgrad", "greedy", *degrees(2, 2)]
    results = {}
    for ep, n in (("2", "2"), ("4", "1")):
        flags = [*overlap, "--expert-model-parallel-size", ep]
        results[f"shadow/ep{ep}_off"] = train(*flags, "--moe-shadow-experts", "off")
        results[f"shadow/ep{ep}_on"] = train(*flags, "--moe-shadow-experts", n)
    profile = ["--moe-cost-profile", ckpt("shadow_profile.json"), *TRUSTED_PROFILE]
    results["shadow/ep2_auto"] = train(
        *overlap, "--expert-model-parallel-size", "2", "--moe-shadow-experts", "auto", *profile
    )
    return results


def tokenizer_runs(base: list[str], iters: list[str]) -> dict:
    """The same corpus through each --tokenizer-type: 4 steps (with dropout: per-rank RNG) saving at step 2, and
    step 2's checkpoint resumed to step 4."""
    with open(TOKENIZER_RUNS) as f:
        data_and_tokenizer = json.load(f)
    model = without(without(without(MODEL, "--lr-warmup-iters"), "--data-path"), "--tokenizer-model")
    results = {}
    for kind, flags in data_and_tokenizer.items():
        run = [*base, *iters, *flags, "--hidden-dropout", "0.1"]
        results[f"{kind}/straight"] = train(*run, "--save", ckpt(kind), "--save-interval", "2", model=model)
        results[f"{kind}/resumed"] = train(*run, "--load", ckpt(f"{kind}/iter_0000002"), model=model)
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
    scenarios = {
        "reference": reference,
        "layouts": layouts,
        "lancet": lancet,
        "esp": esp,
        "pipeline": pipeline,
        "grad_reduce": grad_reduce,
        "megatron_lm": megatron_lm,
        "partition": partition,
        "expert_bias": expert_bias,
    }
    finish_job({**scenarios, "gpu": gpu}[SCENARIO]())
