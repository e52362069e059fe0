"""Lancet's operator partition (`--moe-partition-pieces`) changes no number beyond fp32 rounding, with every overlap on.

`train_worker.partition` trains each layout from the same seed in 1 and 2 pieces, with Lancet's greedy dW queue,
FSMoE's pipeline at 2 x 2 and the adaptive gradient partition (megatron-core's overlapped reduction under the
interleaved pipeline and in the shared-expert run, which also recomputes every module). The pieces run every
MoE all-to-all twice (one per piece, forward and backward), and the losses, gradient norms and parameter norms
agree within 1e-6 relative: a piece's attention, norms, router and experts compute what the micro-batch does for its
sequences (GEMMs of other row counts may round differently), and the router losses are the micro-batch's.
"""

import pytest

from megatron_moe.comm.timers import hidden_share
from tests.distributed.launcher import computed
from tests.distributed.shared_jobs import train_part

JOB_PARTS = {"partition": train_part("partition", timeout=900)}
LAYOUTS = ["ep2", "ep4", "tp2_ep2", "pp2_ep2", "pp2_vpp2_ep2", "ep2_shared_recompute"]
A2A_KINDS = ("a2a_dispatch_bwd", "a2a_combine", "a2a_combine_bwd")


@pytest.fixture(scope="module")
def runs(shared_jobs):
    return shared_jobs.result("partition")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_pieces_train_as_one_within_fp32_rounding(runs, layout):
    whole, pieces = runs[f"{layout}/1"], runs[f"{layout}/2"]
    assert len(whole) == len(pieces) == 4
    for one, two in zip(computed(whole), computed(pieces)):  # losses (lm and the routers'), norms, MoE metrics
        assert one.keys() == two.keys() and {"lm loss", "grad norm", "params norm"} <= one.keys()
        for figure, value in one.items():
            if isinstance(value, dict):  # tokens_per_expert: {MoE layer: routed pairs per expert}
                assert two[figure].keys() == value.keys(), (figure, one, two)
                for layer, counts in value.items():
                    assert two[figure][layer] == pytest.approx(counts, rel=1e-6, abs=1e-12), (figure, one, two)
                continue
            assert two[figure] == pytest.approx(value, rel=1e-6, abs=1e-12), (figure, one, two)
    assert whole[0]["lm loss"] == pieces[0]["lm loss"]  # the first forward: the same weights, per-sequence math


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "pp2_vpp2_ep2"])
def test_each_piece_runs_its_own_all_to_alls(runs, layout):
    """As the logging rank counts them (under PP=2 x VPP=2 it holds layers 2 and 4, both dense)."""
    whole, pieces = runs[f"{layout}/1"][-1]["comm"]["calls"], runs[f"{layout}/2"][-1]["comm"]["calls"]
    for kind in A2A_KINDS:
        assert whole[kind] > 0 and pieces[kind] == 2 * whole[kind], (kind, whole, pieces)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_overlap_report_sets_the_plans_beside_the_timers(runs, layout):
    """--overlap-report (the pieces' runs): iterations 3-4, every all-to-all kind on the wire, the partition as
    installed with its measured hidden time, the gradient partition's prediction where this rank launched it (the
    adaptive schedule on the first pipeline stage: not under PP, whose logging rank is the last stage). Under
    PP=2 x VPP=2 the logging rank's layers (2 and 4) are dense: no all-to-all to report."""
    history = runs[f"{layout}/2"]
    assert [i for i, entry in enumerate(history) if "overlap_report" in entry] == [3]
    report = history[3]["overlap_report"]
    assert report["iterations"] == [3, 4]
    assert report["hidden"] == hidden_share(report["exposed_ms"], report["wire_ms"])
    chunks = report["partition"]
    if layout == "pp2_vpp2_ep2":
        assert report["layers"] == {} and all(chunk["a2a_wire_ms"] == 0 for chunk in chunks), report
    else:
        for kind in ("a2a_dispatch", *A2A_KINDS):
            assert report["kinds"][kind]["wire_ms"] > 0, (kind, report["kinds"])
        assert report["layers"] and all(entry["a2a_wire_ms"] > 0 for entry in report["layers"].values())
    assert chunks and all(pieces == 2 for chunk in chunks for _, _, pieces in chunk["ranges"]), chunks
    assert all(0 <= chunk["a2a_hidden_ms"] <= chunk["a2a_wire_ms"] for chunk in chunks), chunks
    adaptive = layout in ("ep2", "ep4", "tp2_ep2")
    assert ("grad_reduce" in report) == adaptive, report.keys()
    if adaptive:
        assert report["grad_reduce"]["predicted_exposed_ms"] >= 0 and report["grad_reduce"]["wire_ms"] > 0
