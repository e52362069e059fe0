"""The optimizer's rules: Muon's settings, and what Muon does not compose with (each refused by name, with why).

Muon is megatron-core 0.16.1's (optimizer/muon.py); its layer-wise distributed optimizer
(optimizer/layer_wise_optimizer.py) is what Megatron-LM builds for muon with --use-distributed-optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_moe.config.fields import require
from megatron_moe.config.groups_optimizer import MUON_COEFFICIENT_SET_LENGTHS

if TYPE_CHECKING:
    from megatron_moe.config import RunConfig


def check_optimizer(cfg: RunConfig) -> None:
    """Muon's settings (their values always) and the flags Muon cannot run with."""
    t, par = cfg.training, cfg.parallel
    # the values, whichever optimizer runs (a bad one is refused even where it does not apply)
    require(0 <= t.muon_momentum < 1, "--muon-momentum", t.muon_momentum, "must be in [0, 1), e.g. --muon-momentum 0.9")
    require(
        t.muon_extra_scale_factor > 0,
        "--muon-extra-scale-factor",
        t.muon_extra_scale_factor,
        "must be > 0, e.g. --muon-extra-scale-factor 1.0",
    )
    length = MUON_COEFFICIENT_SET_LENGTHS.get(t.muon_coefficient_type, 1)
    require(
        t.muon_num_ns_steps >= 1 and t.muon_num_ns_steps % length == 0,
        "--muon-num-ns-steps",
        t.muon_num_ns_steps,
        f"must be a positive multiple of {length}, the length of --muon-coefficient-type "
        f"{t.muon_coefficient_type}'s coefficient set, e.g. {length}",
    )
    if not t.uses_muon:
        return
    require(
        not t.fp16,
        "--fp16",
        True,
        f"with --optimizer {t.optimizer}: megatron-core's Muon refuses fp16 (it has no loss scaler); use --bf16",
    )
    require(
        t.muon_fp32_matmul_prec != "low",
        "--muon-fp32-matmul-prec",
        "low",
        "torch's float32 matmul precision is highest, high or medium (torch.set_float32_matmul_precision refuses "
        "low); use medium (bfloat16 iterations) or high",
    )
    layer_wise = cfg.optimizer_kind == "layer_wise_muon"
    require(
        not layer_wise or t.bf16,
        "--bf16",
        False,
        "with Muon's layer-wise distributed optimizer (--use-distributed-optimizer): megatron-core 0.16.1's "
        "LayerWiseDistributedOptimizer saves only bf16 runs' state (its fp32 sharded_state_dict raises KeyError "
        "'optimizer'); add --bf16, or drop --use-distributed-optimizer",
    )
    require(
        not (layer_wise and par.overlap_param_gather),
        "--overlap-param-gather",
        True,
        "with Muon's layer-wise distributed optimizer: megatron-core 0.16.1 all-gathers the updated parameters in "
        "its step (no bucketed gather to overlap with the next forward); drop it",
    )
    require(
        not (layer_wise and par.num_distributed_optimizer_instances > 1),
        "--num-distributed-optimizer-instances",
        par.num_distributed_optimizer_instances,
        "1 with Muon: its layer-wise distributed optimizer assigns whole parameters over all data-parallel ranks "
        "(megatron-core 0.16.1 has no partial instances for it)",
    )
