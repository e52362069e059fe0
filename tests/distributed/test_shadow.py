"""FasterMoE's shadow experts change no number beyond fp32 reordering (`shadow_worker.py`, 4 gloo ranks, one torchrun
job): at EP=2 (expert-DP 2) and EP=4, with 1, 2 and 3 experts shadowed, unpipelined and in FSMoE's chunked pipeline,
and with a deferring weight-gradient store (Lancet's protocol), the output, the input gradient, the experts' weight
gradients (each owner's: its own rows' dW plus the shadows' reduced to it) and the router / shared expert gradients
are within 1e-6 of the largest value of the layer without shadowing. Every rank shadows the same experts; each
shadowed expert costs one broadcast forward and one reduce backward; the host still waits once per forward+backward.
"""

import pytest

from tests.distributed.shared_jobs import Part

JOB_PARTS = {"shadow_layer": Part("shadow_worker", "cases", 4, timeout=300)}
REL_TOL = 1e-6
GROUPS = ("output", "input_grad", "expert_grads", "router_and_shared_grads")
LAYOUTS = ("ep2", "ep4")
CASES = ("gelu", "swiglu_shared_losses")


@pytest.fixture(scope="module")
def results(shared_jobs):
    return shared_jobs.result("shadow_layer")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_shadowing_equals_the_layer_without_it(results, layout, case):
    figures = results[f"{layout}/{case}"]
    assert figures["scale"] > 1e-2  # the layer computed something
    runs = {name: f for name, f in figures.items() if name != "scale"}
    assert set(runs) == {f"N{n}/{d}" for n in (1, 2, 3) for d in ("1x1", "2x2")} | {"deferred/1x1", "deferred/2x2"}
    for name, run in runs.items():
        for group in GROUPS:
            assert run[f"{group}_rel"] <= REL_TOL, (name, group, run)
    for n in (1, 2, 3):
        for degrees in ("1x1", "2x2"):
            run = runs[f"N{n}/{degrees}"]
            assert len(run["shadowed"]) == n and run["agreed"], run
            # one broadcast forward and one reduce backward per shadowed expert
            assert run["collectives"] == [["shadow_broadcast", False]] * n + [["shadow_reduce", True]] * n, run
    for degrees in ("1x1", "2x2"):  # the deferred dW ran under a backward all-to-all
        assert runs[f"deferred/{degrees}"]["ran_under"], runs[f"deferred/{degrees}"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_host_waits_once_per_forward_and_backward_with_shadows(results, layout):
    assert results[f"{layout}/host_syncs"] == {"max": 1, "min": 1}
