"""megatron_moe/overlap/profiler.py without a process group: its settings' checks and sizes."""

import pytest

from megatron_moe.config.fields import ConfigError
from megatron_moe.overlap.profiler import ExpertWork, ProfileSettings


def test_settings_name_what_is_wrong():
    ProfileSettings().validate()
    with pytest.raises(ConfigError, match="comm_bytes"):
        ProfileSettings(comm_bytes=(1024,)).validate()
    with pytest.raises(ConfigError, match="experts"):  # one degree, one row count: one chunk size, no slope
        ProfileSettings(experts=ExpertWork(rows=(1024,), degrees=(2,))).validate()
    with pytest.raises(ConfigError, match="experts.hidden_size=0"):
        ProfileSettings(experts=ExpertWork(hidden_size=0)).validate()


def test_expert_blocks_split_evenly_at_every_degree():
    work = ExpertWork(num_local_experts=4, sources=2, rows=(1000,), degrees=(1, 2, 4, 8))
    assert work.block_rows(1000) == 120  # 1000 / (4 x 2) = 125, down to a multiple of lcm(1, 2, 4, 8)
    assert work.block_rows(10) == 8  # at least one row per chunk at the highest degree
    assert ExpertWork(degrees=(1, 3)).block_rows(1024) == 126


def test_layer_settings_measure_the_layers_experts():
    from megatron_moe.overlap.cost_model import LayerSizes
    from megatron_moe.overlap.profiler import layer_profile_settings

    kw = {"tokens": 2048, "topk": 2, "hidden_size": 256, "ffn_hidden_size": 1024, "num_experts": 8}
    sizes = LayerSizes.from_layer(**kw, ep=2, esp=2, gated=True)
    work = layer_profile_settings(sizes, hidden_size=256, ffn_hidden_size=1024, num_experts=8, gated=True).experts
    assert (work.num_local_experts, work.ffn_hidden_size, work.sources, work.gated) == (4, 512, 4, True)
    assert work.rows == (2 * 2048 * 2,)  # the ESP peers' rows gathered: P x T x k
    assert work.rows[0] * work.macs_per_row() == sizes.n_exp
