"""megatron_moe/overlap/profiler.py without a process group: its estimator and its settings' checks."""

import random

import pytest

from megatron_moe.config.fields import ConfigError
from megatron_moe.overlap.profiler import ProfileSettings, usual_mode
from tests.conftest import load_tool

link_tool = load_tool("bench_link")


def test_usual_mode_is_bench_links():
    rng = random.Random(3)
    cases = [[0.069, 0.135, 0.070, 0.134, 0.068], [0.134, 0.135, 0.210, 0.136, 0.071], [1.0, 2.0, 3.0]]
    cases += [[rng.choice([1.0, 2.0]) * rng.uniform(0.95, 1.05) for _ in range(7)] for _ in range(20)]
    for times in cases:
        assert usual_mode(times) == link_tool.usual_mode(times)[0]


def test_settings_name_what_is_wrong():
    ProfileSettings().validate()
    with pytest.raises(ConfigError, match="comm_bytes"):
        ProfileSettings(comm_bytes=(1024,)).validate()
    with pytest.raises(ConfigError, match="gemm_shapes"):
        ProfileSettings(gemm_shapes=((2, 4, 8), (8, 4, 2))).validate()  # equal work: no slope to fit
    with pytest.raises(ConfigError, match="statistic=mean"):
        ProfileSettings(statistic="mean").validate()
