"""The chunked dispatch -> experts -> combine pipeline of our MoE layer equals the layer unpipelined
(EP=2 on 4 gloo ranks, one torchrun job; `pipeline_worker.py`).

Per case (GELU and SwiGLU; the exact-rows and the capacity-padded all-to-all; dropless and with a capacity
factor; a shared expert; router losses) and degrees (r_f, r_b) in (2,2), (4,1), (1,4), (3,2): output, input
gradient, router and expert weight gradients within 1e-6 of the largest value (fp32: a GEMM over fewer rows may
take another kernel path, e.g. a single row's), and bit-identical when the forward is not chunked (r_f = 1: the
backward's chunks change no arithmetic, and the weight gradients are one GEMM over all rows, as at r = 1).
"""

import pytest

from tests.distributed.shared_jobs import Part, train_part

JOB_PARTS = {
    "pipeline_layer": Part("pipeline_worker", "cases", 4),
    "pipeline_training": train_part("pipeline", timeout=900),
}
REL_TOL = 1e-6
GROUPS = ("output", "input_grad", "expert_grads", "router_and_shared_grads")
CASES = (
    "gelu_dropless_v",
    "gelu_dropless_padded",
    "gelu_cap1_v",
    "swiglu_cap1_padded",
    "swiglu_shared_dropless_v",
    "aux_loss_cap125_v",
    # Expert-sharded parallelism, ESP=2 x EP=2: per chunk an ESP all-gather before the experts and a
    # reduce-scatter after them, forward and backward.
    "esp2_ep2/gelu_dropless_v",
    "esp2_ep2/swiglu_cap1_padded",
    "esp2_ep2/swiglu_shared_dropless_v",
)


@pytest.fixture(scope="module")
def results(shared_jobs):
    return shared_jobs.result("pipeline_layer")


@pytest.mark.parametrize("case", CASES)
def test_the_pipeline_equals_the_unpipelined_layer(results, case):
    figures = results[case]
    assert figures["scale"] > 1e-2  # the layer computed something
    assert set(figures) == {"scale", "2x2", "4x1", "1x4", "3x2"}
    for degrees in ("2x2", "4x1", "1x4", "3x2"):
        for group in GROUPS:
            assert figures[degrees][f"{group}_rel"] <= REL_TOL, (degrees, group, figures[degrees])
    for group in GROUPS:  # the forward unchunked: every bit the same
        assert figures["1x4"][f"{group}_equal"], (group, figures["1x4"])


@pytest.mark.parametrize("layout", ["", "esp2_ep2/"])
def test_a_deferring_store_changes_no_bit_and_runs_the_experts_dw_under_the_last_backward_all_to_all(results, layout):
    for degrees, figures in results[f"{layout}deferred_store"].items():
        assert all(figures[f"{group}_equal"] for group in GROUPS), (degrees, figures)
        assert figures["ran_under"] == [["a2a_dispatch", True]] and figures["left"] == 0, figures


def test_the_host_waits_once_per_forward_and_backward_with_the_pipeline_on(results):
    assert results["host_syncs"] == {"1x1": {"max": 1, "min": 1}, "3x2": {"max": 1, "min": 1}}
    assert results["esp2_ep2/host_syncs"] == {"3x2": {"max": 1, "min": 1}}


def test_each_chunk_has_its_own_all_to_alls_forward_and_backward(results):
    def count(records, purpose, backward):
        return sum(1 for kind, name, layer, bwd in records if name == purpose and bwd == backward and layer == 3)

    for degrees, (forward, backward) in (("1x1", (1, 1)), ("3x2", (3, 2))):
        records = results["collectives"][degrees]
        assert count(records, "dispatch_all_to_all", False) == forward
        assert count(records, "combine_all_to_all", False) == forward
        assert count(records, "combine_all_to_all", True) == backward
        assert count(records, "dispatch_all_to_all", True) == backward
        assert count(records, "exchange_counts", False) == 1
        esp = results["esp2_ep2/collectives"][degrees]
        for purpose in ("dispatch_all_to_all", "combine_all_to_all", "esp_all_gather", "esp_reduce_scatter"):
            assert count(esp, purpose, False) == forward, (purpose, esp)
            assert count(esp, purpose, True) == backward, (purpose, esp)


LAYOUTS = ("ep2", "ep2_swiglu_padded", "tp2_ep2", "pp2_ep2", "ep2_arctic", "ep2_accumulate", "esp2_ep2", "tp2_esp2_ep2")


@pytest.fixture(scope="module")
def training(shared_jobs):
    return shared_jobs.result("pipeline_training")


def _figures(history: list[dict]) -> list[tuple]:
    return [(step["lm loss"], step["grad norm"], step["params norm"]) for step in history]


def _within(got: list[tuple], want: list[tuple], rel: float) -> bool:
    return all(abs(a - b) <= rel * abs(b) for g, w in zip(got, want) for a, b in zip(g, w))


@pytest.mark.parametrize("name", [f"{layout}/3x2" for layout in LAYOUTS] + ["ep2/2x2", "ep2/4x1"])
def test_training_with_the_pipeline_equals_training_without(training, name):
    """4 steps: lm loss, grad norm (router and aux-loss gradients in it) and params norm within 1e-6 relative."""
    layout = name.split("/")[0]
    want, got = _figures(training[f"{layout}/1x1"]), _figures(training[name])
    assert len(got) == len(want) == 4
    assert _within(got, want, REL_TOL), (got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_pipeline_ran_its_chunks_in_training(training, layout):
    """The timers' call counts: r_f combine all-to-alls forward and r_b backward where r = 1 has one of each."""
    for one, chunked in zip(training[f"{layout}/1x1"], training[f"{layout}/3x2"]):
        calls, chunked_calls = one["comm"]["calls"], chunked["comm"]["calls"]
        assert calls["a2a_combine"] > 0
        assert chunked_calls["a2a_combine"] == 3 * calls["a2a_combine"], (calls, chunked_calls)
        assert chunked_calls["a2a_combine_bwd"] == 2 * calls["a2a_combine_bwd"], (calls, chunked_calls)


def test_backward_chunks_alone_change_no_bit_in_training(training):
    assert _figures(training["ep2/1x4"]) == _figures(training["ep2/1x1"])


def test_lancet_under_the_pipeline_changes_no_bit(training):
    """The experts' one dW closure queued by Lancet and run under a later all-to-all: the same numbers."""
    assert _figures(training["ep2_lancet/3x2"]) == _figures(training["ep2/3x2"])
    assert all(step["wgrad"]["under_a2a"] > 0 for step in training["ep2_lancet/3x2"])


def test_auto_runs_the_degrees_the_solver_gives_for_the_cached_profile(training):
    """--moe-pipeline-degree auto (the default): a run that fails before its first iteration caches no profile;
    the next measures it and caches it after its first iteration, the one after reuses it (not rewritten); both
    runs' layers ran the solver's degrees for it (combine all-to-alls counted against the r = 1 run's: r_f
    forward, r_b backward), said the same degrees in their one start-up line, and trained like the unpipelined
    run (1e-6 relative)."""
    failed = training["ep2_auto_failed"]
    assert failed["failed"] and not [name for name in failed["files"] if name.endswith(".json")], failed
    assert [name.endswith(".table.txt") for name in failed["files"]] == [True], failed  # the table, for people
    cache = training["ep2_auto_cache"]
    assert len(cache["files"]) == 1 and cache["files"][0].startswith("cost_profile_") and not cache["rewritten"]
    measured, reused = training["ep2_auto_lines"]
    schedule = training["ep2_auto_schedule"]
    degrees = f"pipeline degrees {schedule['forward']}/{schedule['backward']} (forward/backward)"
    assert measured.startswith("cost model: profile measured in ") and "saved to " in measured, measured
    assert reused.startswith("cost model: profile reused from ") and cache["files"][0] in reused, reused
    assert degrees in measured and degrees in reused, (degrees, measured, reused)
    assert "lowest R^2 " in reused and ".table.txt" in reused, reused
    assert schedule["forward"] >= 1 and schedule["backward"] >= 1
    one = training["ep2/1x1"]
    for name in ("ep2_auto", "ep2_auto_loaded"):
        history = training[name]
        assert len(history) == 4
        for step, reference in zip(history, one):
            calls, reference_calls = step["comm"]["calls"], reference["comm"]["calls"]
            assert calls["a2a_combine"] == schedule["forward"] * reference_calls["a2a_combine"], (name, schedule)
            assert calls["a2a_combine_bwd"] == schedule["backward"] * reference_calls["a2a_combine_bwd"]
        assert _within(_figures(history), _figures(one), REL_TOL), name
