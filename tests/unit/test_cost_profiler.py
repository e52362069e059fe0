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


def test_dense_work_names_what_is_wrong():
    from megatron_moe.overlap.profiler import DenseWork

    DenseWork().validate()
    with pytest.raises(ConfigError, match="dense.batches"):
        ProfileSettings(dense=DenseWork(batches=(2, 2))).validate()
    with pytest.raises(ConfigError, match="dense.topk=5"):
        DenseWork(topk=5).validate()
    # a profile saved before the dense lines still describes settings without them
    assert "dense" not in ProfileSettings().to_json() and ProfileSettings(dense=DenseWork()).to_json()["dense"]


def test_dense_lines_are_measured_on_megatron_cores_layer(megatron_world1):
    """One rank, no EP / ESP / DP: the experts' lines and, with `dense`, the eight dense lines (n = tokens)."""
    import time

    from megatron_moe.overlap.cost_model import DENSE_KINDS
    from megatron_moe.overlap.profiler import DENSE_MEASURED, DenseWork, ProfileGroups, measure_fits

    experts = ExpertWork(num_local_experts=2, hidden_size=32, ffn_hidden_size=32, rows=(64,), degrees=(1, 2, 4))
    dense = DenseWork(hidden_size=64, ffn_hidden_size=128, seq_length=32, batches=(1, 2, 4))
    start = time.perf_counter()
    fits = measure_fits(ProfileGroups(), ProfileSettings(experts=experts, dense=dense, repeats=2))
    elapsed = time.perf_counter() - start
    assert fits.missing_dense() == [] and set(DENSE_MEASURED) <= set(fits.fits)
    for kind in DENSE_MEASURED:
        line = fits[kind]
        assert [n for n, _ in line.points] == [32.0, 64.0, 128.0] and line.alpha >= 0 and line.beta >= 0
        assert all(ms > 0 for _, ms in line.points)
    assert all(fits[f"{k}_bwd"].time_ms(128) > 0 for k in DENSE_KINDS)
    assert elapsed < 30  # ~1 s alone on 2 cores; loose for a shared machine
    without = measure_fits(ProfileGroups(), ProfileSettings(experts=experts, repeats=1))
    assert without.missing_dense() == list(DENSE_KINDS)
