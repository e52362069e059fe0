"""Expert-sharded parallelism (ESP) in one torchrun job of 4 gloo ranks (esp_worker.py).

- `esp_all_gather` / `esp_reduce_scatter` over 2 and 4 ranks, uneven sizes and zero rows: exact values and
  gradients (the reduce-scatter adds the blocks in rank order: the same bits as that sum computed locally).
- The MoE layer at ESP=2 x EP=2, ESP=2 (x DP=2) and ESP=4 equals the single-rank layer with every expert
  whole (GELU and SwiGLU, padded and exact rows, dense ordering, expert choice, soft, a shared expert):
  1e-5 absolute on outputs and the input and expert gradients of magnitude ~0.1-10, 1e-5 relative to the
  largest entry on the router's and shared expert's gradients (which sum over every token: ~1e-5 absolute
  at ESP=4) (fp32; the F slices' partial sums are added in another order), routing statistics equal.
- One host sync per layer forward+backward; every collective through `issue`, ESP's as esp_ag / esp_rs.
- Checkpoints reshard between ESP and EP sizes on load (dist_checkpointing), exactly.
"""

import pytest

from tests.distributed.shared_jobs import Part

JOB_PARTS = {"esp_layer": Part("esp_worker", "cases", 4, timeout=600)}
TOL = 1e-5
LAYOUTS = ("esp2_ep2", "esp2", "esp4")
CASES = (
    "topk_dropless_v",
    "topk_cap1_v",
    "topk_dropless_padded",
    "topk_cap1_padded",
    "swiglu_v",
    "swiglu_padded_shared",
    "sigmoid_dense_cap1",
    "expert_choice_v",
    "soft_padded",
)


@pytest.fixture(scope="module")
def results(shared_jobs):
    return shared_jobs.result("esp_layer")


def test_all_gather_and_reduce_scatter_values_and_gradients(results):
    cases = {k: v for k, v in results.items() if k.startswith("collectives/") and k != "collectives/records"}
    assert results["transport"] == {"mismatches": 0.0, "cases": 4}  # gloo's all-to-all as receives, then sends
    assert len(cases) == 4 * 2 + 3
    bad = {k: v for k, v in cases.items() if any(v.values())}
    assert not bad, bad


def test_esp_collectives_are_recorded_with_their_backward_apart(results):
    assert results["collectives/records"] == [
        ["esp_ag", "esp_all_gather", False, True],
        ["esp_rs", "esp_reduce_scatter", False, True],
        ["esp_rs", "esp_reduce_scatter", True, True],
        ["esp_ag", "esp_all_gather", True, True],
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_esp_layer_equals_the_single_rank_layer(results, layout):
    bad = {}
    for case in CASES:
        figures = results[f"{layout}/{case}"]
        worst = max(figures[k] for k in ("output", "input_grad", "router_and_shared_grads", "expert_grads"))
        if not (worst < TOL and figures["stats_match"] and figures["output_abs_mean"] > 1e-3):
            bad[case] = figures
    assert not bad, bad


def test_each_rank_holds_its_slice_of_every_expert(results):
    """weight1 [L, F/P (2F/P for SwiGLU), H] with F = 48, H = 32, E = 8."""
    assert results["esp2_ep2/topk_dropless_v"]["weight1_shape"] == [4, 24, 32]
    assert results["esp2_ep2/swiglu_v"]["weight1_shape"] == [4, 48, 32]
    assert results["esp2/topk_dropless_v"]["weight1_shape"] == [8, 24, 32]
    assert results["esp4/swiglu_v"]["weight1_shape"] == [8, 24, 32]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_host_sync_per_layer_forward_and_backward(results, layout):
    """Every ESP peer's received counts come with the layer's own counts in the one read of MoELayer.arrange."""
    for case in ("topk_cap1_v", "topk_cap1_padded", "swiglu_v"):
        figures = results[f"{layout}/host_syncs/{case}"]
        assert figures["min"] == figures["max"] == 1 and figures["events"] == ["tolist"], (case, figures)


def test_the_layers_collectives_in_order(results):
    forward = [
        ["a2a_dispatch", "dispatch_all_to_all", 3, False],
        ["esp_ag", "esp_all_gather", 3, False],
        ["esp_rs", "esp_reduce_scatter", 3, False],
        ["a2a_combine", "combine_all_to_all", 3, False],
    ]
    backward = [[kind, purpose, layer, True] for kind, purpose, layer, _ in reversed(forward)]
    plan_v = [["a2a_dispatch", "exchange_counts", 3, False], ["esp_ag", "esp_gather_counts", 3, False]]
    # Padded: one capacity over the EP group, then over the ESP group (the gathered blocks share one C).
    plan_padded = [["a2a_dispatch", "agree_capacity", 3, False]] * 2
    assert results["esp2_ep2/records/topk_cap1_v"] == [*plan_v, *forward, *backward]
    assert results["esp2_ep2/records/topk_cap1_padded"] == [*plan_padded, *forward, *backward]
    esp_only = [forward[1], forward[2], backward[1], backward[2]]  # EP = 1: no all-to-all
    assert results["esp2/records/topk_cap1_v"] == [["esp_ag", "esp_gather_counts", 3, False], *esp_only]
    assert results["esp4/records/topk_cap1_padded"] == [["a2a_dispatch", "agree_capacity", 3, False], *esp_only]


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_checkpoints_reshard_between_esp_and_ep_sizes(results, kind):
    cases = {k: v for k, v in results.items() if k.startswith(f"checkpoint/{kind}/")}
    assert len(cases) == 6
    assert all(err == 0.0 for err in cases.values()), cases
