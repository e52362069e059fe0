"""The profiler's all-to-all line on 2 emulated nodes x 1 process (tools/emulated_cluster.py; needs root, `ip` and
`tc`): its slope is the link rate tools/bench_link.py measures, within 25%.

Both time the transport's all-to-all (megatron_moe/comm/transport.py), the median of 9 calls per size, at 2, 4 and
8 MiB per rank over a 0.5 Gbit/s link. In a 2-rank all-to-all half of each rank's n bytes cross its node's link,
so the fitted beta (ms per byte a rank sends) is 1000 / (2 x bench_link's bytes_per_s).
"""

import os
import tempfile

import pytest

from megatron_moe.overlap.cost_model import ClusterFits
from tests.conftest import load_tool

pytestmark = pytest.mark.quiet_cores  # wall-clock bounds of milliseconds

profile_tool = load_tool("profile_cluster")
link_tool = load_tool("bench_link")
cluster_tool = load_tool("emulated_cluster")
LINK_GBIT = 0.5
SIZES_MIB = (2, 4, 8)
TOLERANCE = 0.25


def _measure(cluster, directory: str, attempt: int) -> tuple[float, float, dict]:
    out = os.path.join(directory, f"fits{attempt}.json")
    argv = ["--cluster", "2x1", "--link-gbit", str(LINK_GBIT), "--out", out]
    argv += ["--repeats", "9", "--comm-kib", *(str(mib * 1024) for mib in SIZES_MIB)]
    result = profile_tool.run_on_cluster(profile_tool.parse_args(argv), profile_tool.worker_flags(argv), cluster)
    fits = ClusterFits.from_json(result["fits"])
    assert result["measured"] and ClusterFits.load(out) == fits
    calibrated = link_tool.calibrate(LINK_GBIT, SIZES_MIB, 9, cluster)
    return fits["a2a"].beta, 1000.0 / (2 * calibrated["bytes_per_s"]), {"fit": fits["a2a"], "link": calibrated}


def test_fitted_all_to_all_slope_is_the_calibrated_link_rate():
    with cluster_tool.EmulatedCluster(2, LINK_GBIT) as cluster, tempfile.TemporaryDirectory() as directory:
        beta, expected, seen = _measure(cluster, directory, 0)
        assert beta == pytest.approx(expected, rel=TOLERANCE), seen
        assert seen["fit"].r2 > 0.95, seen
