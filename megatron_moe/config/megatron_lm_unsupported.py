"""Megatron-LM features this stack does not have, each with its flags and the reason: the one list of them.

Out: `UNSUPPORTED` (feature, reason, the flags refused whatever their value, flag prefixes refused, and values of
flags known here that ask for it), `refused_flags()` (flag -> (takes a value, the line)), `refused_value(flag,
value)` and `refused_prefix(flag)`. `megatron_lm.accept_megatron_lm_flags` refuses through them before parsing;
docs/flags.md's "Not supported here" table lists the same features and flags (a test checks it both ways).
A flag named with `=` takes a value.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A Megatron-LM feature that is refused by name: `flags` whatever their value, `prefixes` (every flag
    starting so), and `values` of flags that exist here (flag -> the values that ask for the feature)."""

    feature: str
    reason: str
    flags: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    values: tuple[tuple[str, tuple[str, ...]], ...] = ()


_GPU = "a GPU-only feature this stack does not build"
UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported(
        "CUDA graphs",
        f"{_GPU}; every step runs eagerly here",
        flags=(
            "--enable-cuda-graph",
            "--external-cuda-graph",
            "--cuda-graph-impl=",
            "--cuda-graph-scope=",
            "--cuda-graph-modules=",
            "--cuda-graph-warmup-steps=",
            "--optimizer-cuda-graph",
        ),
    ),
    Unsupported(
        "FP8 and FP4 training",
        f"{_GPU} (transformer-engine's FP8/FP4 GEMMs); train in --bf16",
        flags=(
            "--fp8-format=",
            "--fp8-recipe=",
            "--fp8-margin=",
            "--fp8-interval=",
            "--fp8-amax-history-len=",
            "--fp8-amax-compute-algo=",
            "--fp8-param-gather",
            "--fp8-output-proj",
            "--no-fp8-wgrad",
            "--first-last-layers-bf16",
            "--fp4-format=",
            "--fp4-recipe=",
            "--fp4-param-gather",
        ),
    ),
    Unsupported(
        "Megatron-FSDP and torch FSDP2",
        "parameters are sharded by the distributed optimizer here (--use-distributed-optimizer)",
        flags=(
            "--use-megatron-fsdp",
            "--use-torch-fsdp2",
            "--data-parallel-sharding-strategy=",
            "--outer-dp-sharding-strategy=",
            "--megatron-fsdp-main-params-dtype=",
            "--megatron-fsdp-main-grads-dtype=",
            "--megatron-fsdp-grad-comm-dtype=",
            "--fsdp-double-buffer",
            "--init-model-with-meta-device",
            "--use-nccl-ub",
        ),
        values=(("--ckpt-format", ("fsdp_dtensor",)),),
    ),
    Unsupported(
        "activation offloading",
        "activations stay on the device; save memory with --recompute-granularity or --activation-policy",
        flags=(
            "--fine-grained-activation-offloading",
            "--offload-modules=",
            "--cpu-offloading-num-layers=",
            "--optimizer-cpu-offload",
            "--optimizer-offload-fraction=",
        ),
        prefixes=("--moe-paged-stash",),
    ),
    Unsupported(
        "optimizers other than Adam and Muon",
        "megatron-core 0.16.1 builds Adam(W) and Muon here (--optimizer adam, muon); SGD is not wired, and Lion, "
        "SOAP and adaptive Muon are not in megatron-core 0.16.1",
        values=(("--optimizer", ("sgd", "lion", "soap", "adaptive_muon")),),
    ),
    Unsupported(
        "context-parallel variants",
        "context parallelism here is megatron-core's default (--context-parallel-size, transformer-engine's "
        "attention on a GPU): its other communication types and hierarchical or hybrid CP are not wired",
        flags=("--cp-comm-type=", "--hierarchical-context-parallel-sizes=", "--hybrid-context-parallel"),
    ),
    Unsupported(
        "the flex dispatcher (DeepEP, HybridEP)",
        "tokens move by torch.distributed all-to-all here (--moe-token-dispatcher-type alltoall), overlapped by "
        "--overlap-wgrad and --moe-pipeline-degree",
        flags=(
            "--moe-enable-deepep",
            "--moe-deepep-num-sms=",
            "--moe-flex-dispatcher-backend=",
            "--moe-flex-dispatcher-num-sms=",
            "--moe-permute-fusion-into-hybridep",
            "--moe-ncclep-zero-copy",
            "--moe-dispatch-fwd-dtype=",
            "--moe-combine-bwd-dtype=",
            "--moe-expert-rank-capacity-factor=",
        ),
        prefixes=("--moe-hybridep-",),
        values=(("--moe-token-dispatcher-type", ("flex",)),),
    ),
    Unsupported(
        "quantile balancing",
        "Megatron-LM's quantile-balancing router (a per-expert bias by dual coordinate descent, added after "
        "megatron-core 0.16.1) is not built here; balance with --moe-router-enable-expert-bias (DeepSeek-V3's "
        "aux-loss-free bias) or a balancing loss",
        flags=("--moe-router-quantile-balancing-ema=",),
        values=(("--moe-router-load-balancing-type", ("quantile_balancing",)),),
    ),
    Unsupported(
        "transformer-engine's grouped-tensor and interleaved-GLU expert layouts",
        "the experts' weights are one tensor per expert matrix here (our layer's grouped GEMM, or megatron-core's "
        "GroupedMLP / TEGroupedMLP), GLU halves not interleaved",
        flags=(
            "--moe-use-grouped-tensor",
            "--moe-single-grouped-weight",
            "--moe-single-grouped-bias",
            "--use-grouped-gemm-for-shared-expert",
            "--moe-shared-expert-glu-interleave-size=",
            "--moe-mlp-glu-interleave-size=",
        ),
    ),
    Unsupported(
        "MoE latent projections",
        "the experts read and write the hidden size here (no down/up projection around the MoE layer)",
        flags=("--moe-latent-size=",),
    ),
    Unsupported(
        "generalised tensor parallelism (expert weight rematerialisation)",
        "expert weights are sharded by --expert-tensor-parallel-size alone here",
        flags=("--expert-tensor-parallel-num-weight-shards=",),
        prefixes=("--gtp-",),
    ),
    Unsupported(
        "stage sizes by first/last stage",
        'uneven stages are said with --pipeline-model-parallel-layout here (e.g. "Et*3|(tt|)*6L"), not by '
        "first/last stage sizes",
        flags=(
            "--decoder-first-pipeline-num-layers=",
            "--decoder-last-pipeline-num-layers=",
            "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split",
        ),
    ),
    Unsupported(
        "transformer-engine's op fuser",
        "the layers are megatron-core's modules (local or transformer-engine), not TE's fused operations",
        flags=("--use-transformer-engine-op-fuser",),
    ),
    Unsupported(
        "TikTokenizer",
        "its ids are tiktoken's ranks shifted past its special tokens, which no tokenizer here reproduces "
        "(--tokenizer-type TikTokenizer is refused with the tokenizers to use)",
        flags=("--tiktoken-pattern=", "--tiktoken-num-special-tokens=", "--tiktoken-special-tokens="),
    ),
    Unsupported(
        "reinforcement learning and inference",
        "this stack pretrains: no GRPO, rollouts or inference engine",
        flags=("--perform-rl-step", "--langrl-env-config=", "--max-tokens-to-oom=", "--moe-enable-routing-replay"),
        prefixes=("--grpo-", "--rl-", "--inference-"),
    ),
    Unsupported(
        "fine-tuning from another run's flags",
        "the flags are the ones given (a checkpoint's model flags must match them; --load checks); to start "
        "from a checkpoint's weights use --load with --no-load-optim --no-load-rng",
        flags=("--finetune", "--use-checkpoint-args"),
    ),
)
"""Every Megatron-LM feature refused here by name (docs/flags.md: Not supported here)."""


def _flag_table() -> dict[str, tuple[bool, str]]:
    table = {}
    for item in UNSUPPORTED:
        for flag in item.flags:
            name = flag.rstrip("=")
            table[name] = (flag.endswith("="), f"{item.feature} is not supported here: {item.reason}")
    return table


REFUSED_FEATURE_FLAGS = _flag_table()
"""flag -> (takes a value, the refusal): `UNSUPPORTED`'s flags refused whatever their value."""


REFUSED_VALUE_FLAGS = frozenset(name for item in UNSUPPORTED for name, _ in item.values)
"""The flags some of whose values ask for a refused feature (`--optimizer`, `--moe-token-dispatcher-type`)."""


def refused_prefix(flag: str) -> str | None:
    """The refusal of a flag of a refused family (`--gtp-...`, `--rl-...`), or None."""
    for item in UNSUPPORTED:
        if flag.startswith(item.prefixes or ("\0",)):
            return f"{flag}: {item.feature} is not supported here: {item.reason}"
    return None


def refused_value(flag: str, value: str | None) -> str | None:
    """The refusal of `flag value` where that value asks for a refused feature (`--optimizer sgd`), or None."""
    for item in UNSUPPORTED:
        for name, values in item.values:
            if flag == name and value in values:
                return f"{flag}={value}: {item.feature} is not supported here: {item.reason}"
    return None


def unsupported_flags() -> set[str]:
    """Every flag name refused by feature (prefixes as `--gtp-*`), and `flag=value` for the refused values."""
    names = set(REFUSED_FEATURE_FLAGS) | {p + "*" for item in UNSUPPORTED for p in item.prefixes}
    return names | {f"{flag}={v}" for item in UNSUPPORTED for flag, values in item.values for v in values}
