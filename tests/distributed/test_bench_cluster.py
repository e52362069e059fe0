"""The benchmarks at EP >= 2 on an emulated cluster: tools/bench_step.py and
tools/bench_moe_layer.py --cluster, each one tiny case on 2 nodes x 1 process (EP=2, every all-to-all crosses the
link): their JSON rows have the fields later issues extend, and the all-to-alls show up as exposed time and bytes.
Needs root, `ip` and `tc` (tests/distributed/test_emulated_cluster.py says what is missing)."""

import json

from megatron_moe.overlap.cost_model import BACKWARD_KINDS, FIT_KINDS, OVERHEAD_KINDS
from tests.conftest import load_tool

cluster_tool = load_tool("emulated_cluster")
bench_step = load_tool("bench_step")
bench_layer = load_tool("bench_moe_layer")
bench_layer_ep = load_tool("bench_moe_layer_ep")
bench_pipeline = load_tool("bench_pipeline")

A2A = ("a2a_dispatch", "a2a_dispatch_bwd", "a2a_combine", "a2a_combine_bwd")
ESP = ("esp_ag", "esp_ag_bwd", "esp_rs", "esp_rs_bwd")
KINDS = (*A2A, *ESP, "shadow", "shadow_bwd", "dp_grad_reduce", "tp", "pp_p2p", "other")  # the timers' SUMMARY_KINDS
TINY_MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--ffn-hidden-size", "128", "--num-experts", "4", "--micro-batch-size", "2",
    "--cost-profile-min-r2", "0",
]  # fmt: skip
"""The tiny model; every fitted line trusted (`--cost-profile-min-r2 0`): these tests check what the benchmark
reports of the plans, so the plans must be made (the first case's profile, which the others reuse, fitted on a
busy host with R^2 below 0.9 would otherwise put every auto choice at its default: no adaptive plan, no floor).
The trust rule has its own tests (tests/unit/test_cost_profile_cache.py)."""


def test_the_baseline_plan_alternates_layouts_rates_and_policies():
    policies = ("off", "greedy")
    cases = bench_step.plan(["2x1", "2x2"], [0.5, 1.0, 2.5], rounds=2, policies=policies)
    every = [(layout, rate, p) for layout in ("2x1", "2x2") for rate in (0.5, 1.0, 2.5) for p in policies]
    assert sorted(cases) == sorted(every * 2)
    pairs = [cases[i : i + 2] for i in range(0, len(cases), 2)]  # a (layout, rate)'s policies back to back
    assert all(a[:2] == b[:2] and a[2] != b[2] for a, b in pairs)
    assert {a[2] for a, _ in pairs} == set(policies)  # which policy goes first rotates
    layouts = [a for a, _ in pairs]
    assert all(a[0] != b[0] for a, b in zip(layouts, layouts[1:]) if a[1] == b[1])  # layouts interleaved per rate
    assert [r for _, r, _ in layouts[:6:2]] != [r for _, r, _ in layouts[6::2]]  # the rates' order rotates
    flags = bench_step.trainer_flags("2x2", 3, ("DATA", "TOK"), None)
    assert bench_step._flag(flags, "--moe-pipeline-degree") == "1"
    assert bench_step._flag(flags, "--overlap-wgrad") == "off"
    esp = bench_step.trainer_flags("2x2esp", 3, ("DATA", "TOK"), None, "pipeline")
    assert bench_step._flag(esp, "--expert-tensor-parallel-size") == "2"
    assert bench_step._flag(esp, "--expert-model-parallel-size") == "2"
    assert bench_step._flag(esp, "--moe-bp-pipeline-degree") == "auto"
    assert bench_step._flag(esp, "--overlap-wgrad") == "greedy"
    assert bench_step.layout_name("2x2esp") == "2x2esp EP=2 DP=4 ESP=2"
    defaults = bench_step.parse_args([])
    assert defaults.cluster == ["2x1", "2x2"] and defaults.overlap == list(bench_step.DEFAULT_SETTINGS)
    assert bench_step.parse_args(["--overlap", "all-off", "all-on", "off"]).overlap == ["off", "adaptive"]
    assert bench_step.parse_args(["--overlap", "features", "off"]).overlap == list(bench_step.FEATURES)
    pieces = bench_step.trainer_flags("2x1", 3, ("D", "T"), None, "partition2")
    assert (
        bench_step._flag(pieces, "--moe-partition-pieces") == "2"
        and bench_step._flag(pieces, "--moe-partition-range") == "all"
    )
    assert bench_step._flag(pieces, "--moe-pipeline-degree") == "auto"
    small = bench_step.trainer_flags("2x2dp", 3, ("DATA", "TOK"), None, "grad_small")
    assert bench_step._flag(small, "--expert-model-parallel-size") == "2" and "--overlap-grad-reduce" in small
    assert bench_step._flag(small, "--ddp-bucket-size") == str(bench_step.SMALL_BUCKET)
    assert bench_step._flag(small, "--grad-reduce-schedule") == "megatron"
    assert bench_step._flag(bench_step.trainer_flags("2x1", 3, ("D", "T"), None, "adaptive"), "--grad-reduce-schedule")
    assert bench_step.cluster_of("2x2dp") == (2, 2) and bench_step.layout_name("2x2dp") == "2x2dp EP=2 DP=4 e+d"
    assert bench_step._flag(flags, "--expert-model-parallel-size") == "4"
    assert bench_step._flag(flags, "--global-batch-size") == str(4 * int(bench_step._flag(flags, "--micro-batch-size")))


def test_bench_step_on_two_nodes_reports_every_kind_and_exposed_all_to_alls(train_data):
    args = bench_step.parse_args(["--steps", "4", "--warmup", "2", "--model", *TINY_MODEL])
    with cluster_tool.EmulatedCluster(2, 2.0) as cluster:
        history = bench_step.run_case(cluster, "2x1", 0.5, "off", args, train_data)
        greedy = bench_step.run_case(cluster, "2x1", 0.5, "greedy", args, train_data)
        pipeline = bench_step.run_case(cluster, "2x1", 0.5, "pipeline", args, train_data)
        adaptive = bench_step.run_case(cluster, "2x1", 0.5, "adaptive", args, train_data)
        pieces = bench_step.run_case(cluster, "2x1", 0.5, "partition2", args, train_data)
    flags = bench_step.trainer_flags("2x1", 4, train_data, args.model)
    row = bench_step.summarize("2x1", 0.5, [history, history], args.warmup, flags)
    json.dumps(row)  # a JSON line
    assert row["case"] == "step_2x1_0.5gbit" and row["layout"] == "2x1 EP=2 DP=2" and row["link_gbit"] == 0.5
    assert row["overlap"] == {
        "overlap_wgrad": "off",
        "pipeline_degree": 1,
        "bp_pipeline_degree": 1,
        "grad_reduce_schedule": "megatron",
        "overlap_grad_reduce": False,
        "ddp_bucket_size": None,
        "partition_pieces": 1,
    }
    assert row["wgrad"] is None and row["pipeline_degrees"] == {"1": [1, 1], "2": [1, 1]}, row["pipeline_degrees"]
    assert row["steps"] == 4 and row["rounds"] == 2 and len(row["step_ms_all"][0]) == 4
    # Pooled rounds: the mean over [history, history] is the mean over the one history's timed steps.
    assert row["bytes"] == bench_step.summarize("2x1", 0.5, [history], args.warmup, flags)["bytes"]
    for field in ("comm_ms", "exposed_ms", "wire_ms", "skew_ms", "transfer_ms", "bytes", "wire_bytes", "calls"):
        assert set(row[field]) == set(KINDS), (field, row[field])
    assert set(row["exposed_frac_of_step"]) == set(KINDS)
    assert row["step_ms"] > 0 and 0.0 <= row["hidden_frac"] <= 1.0
    for kind in A2A:  # EP=2: this rank's own block of every all-to-all stays; about half crosses
        assert 0 < row["wire_bytes"][kind] < row["bytes"][kind], (kind, row["wire_bytes"], row["bytes"])
        assert row["wire_ms"][kind] > 0 and row["wire_from"][kind] == "fit", (kind, row)  # the link probe's line
    for kind in KINDS:  # exposed = skew + transfer, per step and so in the steps' means (each rounded to 0.001)
        skew, transfer, exposed = (row[field][kind] for field in ("skew_ms", "transfer_ms", "exposed_ms"))
        assert skew >= 0.0 and transfer >= 0.0 and abs(skew + transfer - exposed) <= 0.01, (kind, row)
    for kind in A2A:  # measured from every rank's arrival stamps (EP=2: the two ranks' stamps exchanged)
        assert row["skew_from"][kind] == "arrivals", (kind, row["skew_from"])
    assert row["skew_from"]["dp_grad_reduce"] == "" and row["skew_ms"]["dp_grad_reduce"] == 0.0
    for kind in A2A:  # EP=2 across the link: every MoE all-to-all sends bytes and blocks the step
        assert row["bytes"][kind] > 0 and row["exposed_ms"][kind] > 0 and row["calls"][kind] >= 1, (kind, row)
    assert row["bytes"]["dp_grad_reduce"] > 0  # DP=2: the dense gradients are all-reduced
    # The figures are within the step: what the timers saw blocked cannot exceed the step's time.
    assert row["exposed_ms_total"] <= max(h["step_ms"] for h in history[1:]), row
    # Lancet's row: greedy planned from the profiled step 2, and its dW ran under the backward all-to-alls.
    on = bench_step.summarize("2x1", 0.5, [greedy], args.warmup, flags, "greedy")
    assert on["case"] == "step_2x1_0.5gbit_wgrad_greedy" and on["overlap_wgrad"] == "greedy"
    assert on["wgrad"]["under_a2a"] > 0 and on["wgrad"]["peak_held_mb"] > 0, on["wgrad"]
    versus = bench_step.compare(row, on)
    json.dumps(versus)
    assert versus["case"] == "overlap_wgrad_2x1_0.5gbit" and versus["bwd_a2a_exposed_ms"]["off"] > 0
    assert versus["bwd_a2a_exposed_cut"] == round(1 - on["bwd_a2a_exposed_ms"] / row["bwd_a2a_exposed_ms"], 3)
    assert versus["step_ratio"] == round(on["step_ms"] / row["step_ms"], 3)
    # FSMoE's row: degrees auto, resolved at set-up from the profile measured in the job, logged in the history.
    piped = bench_step.summarize("2x1", 0.5, [pipeline], args.warmup, flags, "pipeline")
    assert piped["case"] == "step_2x1_0.5gbit_pipeline" and piped["overlap_wgrad"] == "greedy"
    assert piped["pipeline_degree"] == piped["bp_pipeline_degree"] == "auto"
    degrees = piped["pipeline_degrees"]
    assert set(degrees) == {"1", "2"} and all(1 <= d <= 8 for pair in degrees.values() for d in pair), degrees
    pipe_row = bench_step.compare_pipeline(on, piped)
    json.dumps(pipe_row)
    assert pipe_row["case"] == "pipeline_2x1_0.5gbit" and pipe_row["pipeline_degrees"] == degrees
    assert pipe_row["step_ratio"] == round(piped["step_ms"] / on["step_ms"], 3)
    assert set(pipe_row["exposed_ms"]) >= set(A2A) and pipe_row["exposed_ms"]["a2a_dispatch"]["off"] > 0, pipe_row
    # FSMoE's gradient partition: the same run with --grad-reduce-schedule adaptive, against megatron-core's
    planned = bench_step.summarize("2x1", 0.5, [adaptive], args.warmup, flags, "adaptive")
    assert planned["case"] == "step_2x1_0.5gbit_grad_adaptive" and planned["grad_reduce_schedule"] == "adaptive"
    assert planned["bytes"]["dp_grad_reduce"] == piped["bytes"]["dp_grad_reduce"] > 0  # the same bytes reduced
    assert planned["wire_from"]["a2a_dispatch"] == planned["wire_from"]["dp_grad_reduce"] == "fit"  # the profile's
    top = bench_step.headline(row, planned)  # all-off against all-on
    json.dumps(top)
    assert top["case"] == "headline_2x1_0.5gbit" and top["all_on"]["grad_reduce_schedule"] == "adaptive"
    assert top["step_ratio"] == round(row["step_ms"] / planned["step_ms"], 3)
    assert top["hidden_frac"] == {"off": row["hidden_frac"], "on": planned["hidden_frac"]}
    assert top["skew_ms"] == {"off": row["skew_ms_total"], "on": planned["skew_ms_total"]}
    assert top["transfer_ms"] == {"off": row["transfer_ms_total"], "on": planned["transfer_ms_total"]}
    grad_row = bench_step.compare_grad_reduce({"pipeline": piped}, planned)
    json.dumps(grad_row)
    assert grad_row["case"] == "grad_reduce_2x1_0.5gbit" and grad_row["best_megatron"] == "pipeline"
    exposed = grad_row["dp_grad_reduce_exposed_ms"]
    assert exposed == {"pipeline": piped["exposed_ms"]["dp_grad_reduce"], "adaptive": exposed["adaptive"]}
    assert grad_row["step_ratio_vs_best_megatron"] == round(planned["step_ms"] / piped["step_ms"], 3)
    assert piped["grad_reduce_floor_ms"] is None and planned["grad_reduce_floor_ms"] > 0  # the plan's, adaptive only
    assert grad_row["floor_ms"] == planned["grad_reduce_floor_ms"]
    assert grad_row["floor_cut_vs_best_megatron"] == round(1 - grad_row["floor_ms"] / exposed["pipeline"], 3)
    # Lancet's operator partition, 2 pieces through both layers: the history's start-up entry says where they ran
    # (unchunked: auto degrees are solved for whole micro-batches), and every all-to-all runs once per piece.
    split = bench_step.summarize("2x1", 0.5, [pieces], args.warmup, flags, "partition2")
    assert split["case"] == "step_2x1_0.5gbit_partition2" and split["partition_pieces"] == 2
    assert split["operator_partition"] == [{"layers": [1, 2], "ranges": [[1, 2, 2]]}], split["operator_partition"]
    assert split["pipeline_degrees"] == {"1": [1, 1], "2": [1, 1]}, split["pipeline_degrees"]
    for kind in A2A:  # all off ran degrees 1 / 1 too
        assert split["calls"][kind] == 2 * row["calls"][kind], (kind, split["calls"], row["calls"])
    table = bench_step.features({"off": row, "adaptive": planned, "partition2": split})
    json.dumps(table)
    assert table["case"] == "features_2x1_0.5gbit" and set(table["settings"]) == {"off", "adaptive", "partition2"}
    assert table["settings"]["partition2"]["step_ratio"] == round(row["step_ms"] / split["step_ms"], 3)
    assert table["settings"]["partition2"]["operator_partition"] == split["operator_partition"]


def test_bench_moe_layer_cluster_mode_runs_both_layers_at_ep2(capsys):
    args = bench_layer.parse_args(["--cluster", "2x1", "--link-gbit", "1", "--repeats", "2", "--warmup", "1"])
    tokens, hidden, topk = 64, 32, 2
    bench_layer_ep.run_cluster(args, [("tiny", hidden, 64, tokens, 4, topk)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, lines
    row = json.loads(lines[0])
    assert row["case"] == "tiny" and row["layout"] == "2x1 EP=2" and row["ep"] == 2 and row["link_gbit"] == 1.0
    assert row["layer_ms"] > 0 and row["mcore_ms"] > 0 and len(row["layer_ms_all"]) == 2
    assert set(row["exposed_ms"]) == set(A2A), row  # ours: the four MoE all-to-alls, nothing else
    assert all(row["exposed_ms"][k] > 0 and row["comm_ms"][k] > 0 for k in A2A), row
    # Dropless: every rank sends each of its tokens' top-k rows forward, and gets their grads back in the backward.
    rows_bytes = tokens * topk * hidden * 4
    assert row["bytes"]["a2a_dispatch"] >= rows_bytes and row["bytes"]["a2a_combine_bwd"] == rows_bytes, row
    # megatron-core's dispatcher all-to-alls reach the timers through the torch.distributed taps.
    assert sum(row["mcore_bytes"].values()) >= 2 * rows_bytes and sum(row["mcore_exposed_ms"].values()) > 0
    # Lancet's contender: our layer with a weight-gradient queue, same gradients, its dW run under the all-to-alls.
    assert row["overlap_wgrad"] == "all-under-next-a2a" and row["grads_identical"] is True, row
    assert row["overlap"] == {"overlap_wgrad": {"off": "layer_ms", "all-under-next-a2a": "layer_ms_wgrad"}}
    assert row["layer_ms_wgrad"] > 0 and len(row["layer_ms_wgrad_all"]) == 2
    assert set(row["exposed_ms_wgrad"]) == set(A2A) and row["bytes_wgrad"] == row["bytes"], row
    # The experts' one closure per backward waits for the next backward all-to-all (the dispatch's reverse); the
    # router's, made after it, waits for the backward's end (a layer alone has no all-to-all after its router).
    assert row["wgrad"]["under_a2a"] == 1 and row["wgrad"]["at_backward_end"] == 1, row["wgrad"]
    assert row["wgrad"]["natural"] == 0, row["wgrad"]
    assert row["wgrad"]["peak_held_mb"] > 0 and row["wgrad"]["policy"] == "all-under-next-a2a", row["wgrad"]
    off, on = row["bwd_a2a_exposed_ms"]["off"], row["bwd_a2a_exposed_ms"]["on"]
    assert off > 0 and on >= 0 and row["bwd_a2a_exposed_cut"] == round(1 - on / off, 3), row


def test_bench_pipeline_on_2x1_compares_the_solver_with_every_degree_pair():
    args = bench_pipeline.parse_args(
        ["--cluster", "2x1", "--link-gbit", "1", "--repeats", "1", "--degrees", "1", "2"]
        + ["--tokens", "256", "--hidden", "64", "--ffn", "128"]
    )
    (row,) = bench_pipeline.run(args)
    json.dumps(row)
    assert row["layout"] == "2x1 ESP=1 EP=2" and row["link_gbit"] == 1.0, row
    assert set(row["grid"]) == {"1,1", "1,2", "2,1", "2,2", "solver"}  # 2 x 2 degree pairs + the solver's
    assert row["grid"]["solver"]["pipeline_degree"] == "auto" and row["grid"]["2,1"]["pipeline_degree"] == 2
    assert row["pipeline_degree"] == row["bp_pipeline_degree"] == "auto"
    assert row["grads_match"] is True, row
    solver = row["solver"]
    assert solver["forward"] in range(1, 9) and solver["backward"] in range(1, 9), solver
    assert solver["predicted_ms"]["forward"] > 0 and solver["measured_ms"]["backward"] > 0, solver
    assert row["r1_ms"] == row["grid"]["1,1"]["ms"] and row["solver_ms"] == row["grid"]["solver"]["ms"]
    assert row["best_fixed"]["r"] in (1, 2) and row["best_brute_force"]["ms"] <= row["best_fixed"]["ms"]
    assert row["speedup_vs_r1"] == round(row["r1_ms"] / row["solver_ms"], 3)
    assert 0 < row["comm_frac_r1"] < 1, row
    for contender in ("r1", "best_fixed", "solver"):  # EP=2 across the link: the all-to-alls block the layer
        assert row["exposed_ms"][contender]["a2a_dispatch"] > 0, row["exposed_ms"]
    # At these tiny messages gloo's per-call time can swamp the bytes (the fit then holds beta at 0): the line must
    # still give the all-to-all a positive time.
    a2a = row["fits"]["a2a"]
    assert a2a["alpha"] + a2a["beta"] * 4096 > 0 and set(row["fits"]) == {*FIT_KINDS, *BACKWARD_KINDS, *OVERHEAD_KINDS}
