"""megatron-core's --recompute-modules names: mapped onto our activation policies, or refused by name."""

import pytest

from megatron_moe.config import ConfigError
from megatron_moe.config.activation_policy import build_policy
from tests.unit.test_config import cfg


def recomputed(*names):
    policy = build_policy(preset="none", recompute=list(names), quantize=[], quant_format="int8_row")
    return sorted(n for n, mode in policy.modes.items() if mode == "recompute")


def test_megatron_cores_names_mean_our_modules():
    assert recomputed("core_attn") == ["core_attention"]
    assert recomputed("moe_act") == ["expert_act"]
    assert recomputed("layernorm") == ["input_norm", "pre_mlp_norm"]
    assert recomputed("mlp") == ["mlp_act", "mlp_fc1", "mlp_fc2"]
    assert recomputed("shared_experts") == ["shared_expert"]
    assert recomputed("core_attn", "core_attention", "expert_fc1") == ["core_attention", "expert_fc1"]  # ours too
    # megatron-core's whole-block checkpoints: each computing piece from its own input, no all-to-all repeated
    assert recomputed("moe") == ["expert_act", "expert_fc1", "expert_fc2", "router", "shared_expert", "unorder"]
    assert recomputed("mla_up_proj") == ["qkv"]


@pytest.mark.parametrize(
    "name, message",
    [
        ("attn", r"--recompute-modules=attn: a module name, one of: .*or megatron-core's core_attn"),
    ],
)
def test_names_that_mean_nothing_the_same_are_refused_by_name(name, message):
    with pytest.raises(ConfigError, match=message):
        recomputed(name)


def test_the_flag_pass_takes_megatron_lms_selective_recompute():
    c = cfg("--recompute-granularity", "selective", "--recompute-modules", "mlp", "moe_act", "core_attn")
    modes = c.activation_policy().modes
    assert {modes[n] for n in ("mlp_fc1", "mlp_act", "mlp_fc2", "expert_act", "core_attention")} == {"recompute"}
    deepseek_v3 = cfg(
        "--recompute-granularity", "selective", "--recompute-modules", "mlp", "moe", "mla_up_proj", "layernorm"
    )
    modes = deepseek_v3.activation_policy().modes
    assert not {"dispatch", "combine", "ordering"} & {n for n, mode in modes.items() if mode == "recompute"}
