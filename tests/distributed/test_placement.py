"""--expert-placement on 4 gloo ranks at EP=2 x expert-DP=2 (one torchrun job, placement_worker.py).

- The groups each run built are the ones docs/placement.md names: e+d keeps an EP group on consecutive ranks
  (a node of 2), d+e an expert's expert-DP replicas; the dense DP group is the same.
- The same training: from the same seed, d+e's losses, grad norms and params norms equal e+d's to rounding
  (1e-7 relative). Not bit for bit by construction: each expert's gradient is summed over another grouping of the
  4 data shards (placement.py); seen here, the losses are equal bit for bit over the 4 steps and step 4's grad norm
  differs in its 9th digit.
- Checkpoints are portable: a step-2 checkpoint of either placement resumed under the other continues the saving
  run (steps 3-4, to rounding: an expert loaded on the wrong rank would be off by far more), and resumed under its
  own placement bit for bit.
- auto builds the groups of the placement its rule picks for the run's shapes on 2 nodes of 2.
"""

import pytest

from tests.distributed.launcher import assert_matches, computed
from tests.distributed.shared_jobs import Part

JOB_PARTS = {"placement": Part("placement_worker", "cases", 4, ("{data}", "{tokenizer}", "{workdir}"))}
E_D = {"ep": [[0, 1], [2, 3]], "expert_dp": [[0, 2], [1, 3]], "dp": [[0, 1, 2, 3]]}
D_E = {"ep": [[0, 2], [1, 3]], "expert_dp": [[0, 1], [2, 3]], "dp": [[0, 1, 2, 3]]}
ROUNDING = 1e-6
"""fp32 rounding, a few units in the last place: the two placements hold different experts on each rank, so the
grad norm's sums of squares add up in another order (seen: 2.6e-9 and, on an AVX-512 host, 1.03e-7 apart)."""


@pytest.fixture(scope="module")
def runs(shared_jobs):
    return shared_jobs.result("placement")


def test_each_placement_builds_the_groups_it_names(runs):
    assert runs["e+d"]["groups"] == E_D
    assert runs["d+e"]["groups"] == D_E
    assert runs["d+e_as_e+d"]["groups"] == E_D and runs["e+d_as_d+e"]["groups"] == D_E


def test_the_placements_train_the_same_model(runs):
    """Within rounding (`ROUNDING`), far inside the layouts' tolerance (seen: the 4 losses and params norms
    equal bit for bit, one step's grad norm apart)."""
    ed, de = runs["e+d"]["history"], runs["d+e"]["history"]
    assert [s["iteration"] for s in de] == [1, 2, 3, 4]
    assert_matches(de, ed)
    for a, b in zip(de, ed):
        for figure in ("lm loss", "grad norm", "params norm"):
            assert a[figure] == pytest.approx(b[figure], rel=ROUNDING), (figure, a, b)


@pytest.mark.parametrize("saved,resumed", [("d+e", "d+e_as_e+d"), ("e+d", "e+d_as_d+e")])
def test_a_checkpoint_resumes_under_the_other_placement(runs, saved, resumed):
    steps = runs[resumed]["history"]
    assert [s["iteration"] for s in steps] == [3, 4]
    for a, b in zip(steps, runs[saved]["history"][2:]):
        for figure in ("lm loss", "grad norm", "params norm"):
            assert a[figure] == pytest.approx(b[figure], rel=ROUNDING), (figure, a, b)


def test_a_checkpoint_resumes_exactly_under_its_own_placement(runs):
    assert computed(runs["d+e_resumed"]["history"]) == computed(runs["d+e"]["history"][2:])


def test_auto_builds_what_its_rule_picks(runs):
    auto = runs["auto"]
    assert auto["picked"] in ("e+d", "d+e") and auto["why"].startswith("fewer bytes across nodes"), auto["why"]
    assert auto["groups"] == auto["expected_groups"] == {"e+d": E_D, "d+e": D_E}[auto["picked"]]
