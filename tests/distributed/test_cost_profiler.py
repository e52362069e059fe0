"""megatron_moe/overlap/profiler.py on 4 gloo ranks (one torchrun job): every rank fits the same lines, the
profile is saved, and a second call loads it instead of measuring."""

import os

import pytest

from megatron_moe.overlap import profile_cache
from megatron_moe.overlap.cost_model import BACKWARD_KINDS, FIT_KINDS, OVERHEAD_KINDS, ClusterFits
from tests.distributed.shared_jobs import Part

JOB_PARTS = {"cost_profiler": Part("cost_profiler_worker", "cases", 4, ("{workdir}",), timed=True)}


@pytest.fixture(scope="module")
def results(shared_jobs):
    out = shared_jobs.result("cost_profiler")
    return out | {"path": os.path.join(shared_jobs.workdir("cost_profiler"), "fits.json")}


def test_esp_gloo_form_gathers_and_sums(results):
    base = [0.0, 1.0, 2.0, 3.0]
    for rank, got in enumerate(results["esp_traffic"]):
        peers = [rank // 2 * 2, rank // 2 * 2 + 1]  # ESP groups {0, 1}, {2, 3}
        assert got["gathered"] == [v + 10 * p for p in peers for v in base]  # each peer's block, in rank order
        assert got["summed"] == [sum(v + 10 * p for p in peers) for v in base]  # this rank's block, summed


def test_every_rank_fits_the_same_lines_and_the_file_is_saved(results):
    first = results["first"]
    assert all(r["measured"] for r in first) and all(r["saved"] for r in first)
    assert all(r["fits"] == first[0]["fits"] for r in first)
    fits = ClusterFits.from_json(first[0]["fits"])
    assert ClusterFits.load(results["path"]).cluster != fits.cluster  # the file now holds the "changed" profile
    cluster = fits.cluster
    assert (cluster["world"], cluster["ep"], cluster["esp"], cluster["dp"]) == (4, 2, 2, 4)
    assert len(cluster["hosts"]) == 4 and cluster["link"] == "loopback" and cluster["backend"] == "gloo"
    assert cluster["ep_groups"] == [[0, 2], [1, 3]]  # a profile is of one placement's all-to-all (--expert-placement)
    assert cluster["esp_groups"] == [[0, 1], [2, 3]] and cluster["ranks_per_node"] == ["4"] * 4
    assert cluster["code"] == profile_cache.code_version() and len(cluster["device_name"]) == 1
    assert set(fits.fits) == {*FIT_KINDS, *BACKWARD_KINDS, *OVERHEAD_KINDS}
    for kind in set(fits.fits) - set(OVERHEAD_KINDS):  # degrees 1, 2, 4
        fit = fits[kind]
        assert len(fit.points) == 3 and all(ms > 0 for _, ms in fit.points), kind
        assert fit.alpha >= 0 and fit.beta >= 0 and fit.r2 <= 1.0, (kind, fit)
    assert [n for n, _ in fits["a2a"].points] == [16 << 10, 32 << 10, 64 << 10]
    chunk_macs = [256 // r * 64 * 64 * 2 for r in (1, 2, 4)]  # 2 experts x 4 sources x 32 rows, r chunks
    for kind in ("gemm", "gemm_bwd", "gemm_dw"):
        assert [n for n, _ in fits[kind].points] == chunk_macs, kind
    for suffix in ("", "_bwd"):  # the pipeline's time beyond the model (a residual may be negative)
        chunk, unchunked = fits["chunk" + suffix], fits["unchunked" + suffix]
        assert [n for n, _ in chunk.points] == [1, 3]  # r = 2, 4: n = chunks beyond the first
        assert chunk.alpha >= 0 and chunk.beta >= 0 and chunk.r2 <= 1.0, chunk
        assert unchunked.points == ((0.0, unchunked.alpha),) and unchunked.beta == 0.0  # r = 1: no chunks
    assert set(fits.model_error) == {"forward", "backward"}
    assert all(0 <= error < 1 for error in fits.model_error.values()), fits.model_error


def test_collectives_go_through_comm_on_their_groups(results):
    for rank, got in enumerate(results["first"]):
        purposes = {purpose: ranks for kind, purpose, ranks in got["collectives"] if kind == "other"}
        # the micro-benchmarks are "other"; the pipeline runs (the overhead lines) are the layer's own kinds
        assert {kind for kind, _, _ in got["collectives"]} == {
            "other",
            "a2a_dispatch",
            "a2a_combine",
            "esp_ag",
            "esp_rs",
        }
        for kind, _, ranks in got["collectives"]:
            if kind.startswith("a2a_"):
                assert ranks == [rank % 2, rank % 2 + 2], kind
            elif kind.startswith("esp_"):
                assert ranks == [rank // 2 * 2, rank // 2 * 2 + 1], kind
        assert purposes["profile/all_to_all"] == [rank % 2, rank % 2 + 2]  # EP across the two nodes
        assert (
            purposes["profile/esp_all_gather"]
            == purposes["profile/esp_reduce_scatter"]
            == [
                rank // 2 * 2,
                rank // 2 * 2 + 1,
            ]
        )
        assert purposes["profile/all_reduce"] == [0, 1, 2, 3]


def test_a_second_call_loads_instead_of_measuring(results):
    for first, second in zip(results["first"], results["second"]):
        assert not second["measured"] and second["fits"] == first["fits"]
        described = ("profile/rank_facts", "profile/group_ranks", "profile/decision")  # the description, rank 0's say
        timed = [p for _, p, _ in second["collectives"] if p not in described]
        assert timed == [], timed  # no benchmark ran
    changed = results["changed"]
    assert all(r["measured"] for r in changed)  # other settings: the saved profile does not match
    assert changed[0]["fits"]["cluster"]["settings"]["repeats"] == 2


def test_megatron_groups_are_the_tools_groups(results):
    for rank, got in enumerate(results["parallel_state"]):
        assert got["sizes"] == {"ep": 2, "esp": 2, "dp": 4}
        ep, esp, dp = got["megatron"]
        assert [ep, esp] == got["tool"]
        assert esp == [rank // 2 * 2, rank // 2 * 2 + 1] and ep == [rank % 2, rank % 2 + 2] and dp == [0, 1, 2, 3]
