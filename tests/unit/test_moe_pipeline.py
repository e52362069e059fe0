"""FSMoE's chunked pipeline, single process: the chunk planning on the host, and the pipelined
node against the non-pipelined experts and layer.

The planning is checked against a direct construction: every row of the send buffer is in exactly one chunk, in
(destination, expert) order, chunk j taking part j of each block; every row a rank's experts compute is in exactly
one chunk, at its r = 1 position, its own chunk's rows in (expert, source) order. The node at EP = 1 (no
communication) equals the experts run whole: bit-identical with the forward unchunked (the backward's input and
weight gradients, any r_b), within 1e-6 relative otherwise (a GEMM over 1 row takes another kernel path).
"""

import functools

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megatron_moe.config.fields import ConfigError
from megatron_moe.moe import ModuleListExperts, MoEHook, MoELayer, MoELayerConfig
from megatron_moe.moe.experts import FFNExperts
from megatron_moe.moe.pipeline import Links, part, pipelined_experts, plan_chunks

H, FFN = 8, 6


def test_parts_of_a_block_add_up_and_differ_by_at_most_one():
    for count in (0, 1, 2, 5, 7, 16):
        for r in (1, 2, 3, 4, 8):
            parts = [part(count, r, j) for j in range(r)]
            assert sum(parts) == count and max(parts) - min(parts) <= 1, (count, r, parts)


def _expected_send_rows(send_GL, r, j):
    rows, start = [], 0
    for row in send_GL:
        for count in row:
            first = count * j // r
            rows += range(start + first, start + first + part(count, r, j))
            start += count
    return rows


@pytest.mark.parametrize(
    "send_GL, received_XL",
    [
        ([[3, 0], [5, 2]], [[3, 1], [0, 4]]),  # uneven, zero counts, G = 2, L = 2
        ([[4, 4], [4, 4]], [[4, 4], [4, 4]]),  # padded: every block C
        ([[1], [0], [2]], [[2], [1], [0]]),  # L = 1, G = 3
        ([[0, 0, 0]], [[0, 0, 0]]),  # nothing at all
        ([[2, 3], [1, 0]], [[1, 2], [0, 5], [3, 3], [2, 0]]),  # ESP: X = (p, g) with P = 2, this rank p = 1
    ],
)
@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_chunks_partition_the_send_buffer_and_the_expert_rows(send_GL, received_XL, r):
    g_size = len(send_GL)
    esp_rank = len(received_XL) // g_size - 1
    chunks = plan_chunks(send_GL, received_XL, r, esp_rank=esp_rank)
    l_size, x_size = len(send_GL[0]), len(received_XL)
    sent, computed = [], []
    for j, chunk in enumerate(chunks):
        assert chunk.send_rows.tolist() == _expected_send_rows(send_GL, r, j)
        assert chunk.send_splits == [sum(part(c, r, j) for c in row) for row in send_GL]
        mine = received_XL[esp_rank * g_size : (esp_rank + 1) * g_size]
        assert chunk.recv_splits == [sum(part(c, r, j) for c in row) for row in mine]
        peers = [received_XL[p * g_size : (p + 1) * g_size] for p in range(esp_rank + 1)]
        assert chunk.esp_sizes == [sum(part(c, r, j) for row in peer for c in row) for peer in peers]
        assert chunk.counts == [sum(part(received_XL[x][l], r, j) for x in range(x_size)) for l in range(l_size)]
        # The received rows, labelled (x, l, i), come in (x, l) order; the permutation puts them in (l, x) order.
        labels = [(x, l, i) for x in range(x_size) for l in range(l_size) for i in range(part(received_XL[x][l], r, j))]
        order = range(len(labels)) if chunk.to_expert is None else chunk.to_expert.tolist()
        permuted = [labels[i] for i in order]
        assert permuted == sorted(permuted, key=lambda t: (t[1], t[0], t[2]))
        if chunk.to_expert is not None:
            assert [order[i] for i in chunk.to_source.tolist()] == list(range(len(labels)))
        # Their r = 1 positions: expert l's block, source x's sub-block, offset by the earlier chunks' parts.
        r1 = {}
        for l in range(l_size):
            for x in range(x_size):
                for i in range(received_XL[x][l]):
                    r1[(x, l, i)] = len(r1)
        offsets = [[received_XL[x][l] * j // r for l in range(l_size)] for x in range(x_size)]
        assert chunk.expert_rows.tolist() == [r1[(x, l, offsets[x][l] + i)] for x, l, i in permuted]
        sent += chunk.send_rows.tolist()
        computed += chunk.expert_rows.tolist()
    assert sorted(sent) == list(range(sum(map(sum, send_GL))))
    assert sorted(computed) == list(range(sum(map(sum, received_XL))))
    assert len(chunks) == r and g_size == len(chunks[0].send_splits)


def _experts(gated: bool) -> FFNExperts:
    torch.manual_seed(0)
    normal = torch.nn.init.normal_
    return FFNExperts(
        num_local_experts=4,
        hidden_size=H,
        ffn_hidden_size=FFN,
        gated=gated,
        init_method=normal,
        output_init_method=normal,
    )


def _run(fn, x, grad):
    x = x.detach().requires_grad_()
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


def _close(a, b, rtol=1e-6):
    return (a - b).abs().max().item() <= rtol * b.abs().max().item()


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [4, 4, 4, 4], [0, 0, 1, 0], [0, 0, 0, 0]])
@pytest.mark.parametrize("degrees", [(1, 1), (2, 2), (4, 1), (1, 4), (3, 2), (8, 8)])
def test_the_pipelined_node_equals_the_experts_run_whole(gated, counts, degrees):
    experts = _experts(gated)
    x, grad = torch.randn(sum(counts), H), torch.randn(sum(counts), H)
    whole = _run(lambda t: experts(t, counts), x, grad) if sum(counts) else (x, x)
    whole_w = (experts.weight1.grad, experts.weight2.grad)
    experts.zero_grad(set_to_none=True)
    links = Links(None, None, None, None)
    chunked = _run(lambda t: pipelined_experts(t, experts, counts, [counts], degrees, links), x, grad)
    chunked_w = (experts.weight1.grad, experts.weight2.grad)
    if not sum(counts):
        assert chunked[0].shape == (0, H) and all(torch.equal(w, torch.zeros_like(w)) for w in chunked_w)
        return
    for got, want in zip((*chunked, *chunked_w), (*whole, *whole_w)):
        if degrees[0] == 1:  # the forward's arithmetic is unchanged: the backward's chunks change no bit
            assert torch.equal(got, want)
        else:
            assert _close(got, want)


def _pipelined(rows, *, experts, counts, degrees):
    return pipelined_experts(rows, experts, counts, [counts], degrees, Links(None, None, None, None))


@pytest.mark.parametrize("gated", [False, True])
def test_the_pipelined_node_equals_the_experts_run_whole_under_mm_loop(gated):
    """Small experts run torch.mm per expert on CPU (`mm-loop`, where its rows are independent of the call): the
    backward's chunks of 1-5 rows per expert still change no bit (they go through a padded block)."""
    from megatron_moe.moe import grouped_gemm

    hidden, ffn = 32, 24
    experts = FFNExperts(
        num_local_experts=4, hidden_size=hidden, ffn_hidden_size=ffn, gated=gated,
        init_method=torch.nn.init.normal_, output_init_method=torch.nn.init.normal_,
    )  # fmt: skip
    counts = [3, 0, 5, 2]
    x, grad = torch.randn(sum(counts), hidden), torch.randn(sum(counts), hidden)
    if grouped_gemm._kernel(x, experts.weight1.transpose(1, 2), counts, None) != "mm-loop":
        pytest.skip("this CPU's torch.mm gives rows bits that depend on the call: oneDNN runs (the test above)")
    whole = _run(lambda t: experts(t, counts), x, grad)
    whole_w = (experts.weight1.grad, experts.weight2.grad)
    for degrees in ((1, 2), (1, 4)):
        experts.zero_grad(set_to_none=True)
        chunked = _run(functools.partial(_pipelined, experts=experts, counts=counts, degrees=degrees), x, grad)
        for got, want in zip((*chunked, experts.weight1.grad, experts.weight2.grad), (*whole, *whole_w)):
            assert torch.equal(got, want), degrees


def _layer(**fields) -> MoELayer:
    config = TransformerConfig(
        num_layers=2, hidden_size=H * 4, ffn_hidden_size=FFN * 4, num_attention_heads=4, num_moe_experts=4,
        moe_router_topk=2, add_bias_linear=False, use_cpu_initialization=True, bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
    )  # fmt: skip
    moe = MoELayerConfig(num_experts=4, hidden_size=H * 4, ffn_hidden_size=FFN * 4, topk=2, **fields)
    torch.manual_seed(0)
    return MoELayer(config, moe)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"capacity_factor": 1.0, "pad_expert_input_to_capacity": True},
        {"expert_type": "swiglu", "shared_expert_ffn_hidden_size": 16},
    ],
)
def test_a_pipelined_layer_equals_the_unpipelined_one(fields):
    layer = _layer(**fields)
    x, grad = torch.randn(6, 2, H * 4), torch.randn(6, 2, H * 4)
    assert layer.pipeline_degrees() == (1, 1)  # "auto", unresolved
    want = _run(lambda t: layer(t)[0], x, grad)
    want_params = [p.grad.clone() for p in layer.parameters()]
    for degrees in ((2, 3), (1, 2)):
        layer.zero_grad(set_to_none=True)
        layer.set_pipeline_degrees(*degrees)
        got = _run(lambda t: layer(t)[0], x, grad)
        for a, b in zip((*got, *(p.grad for p in layer.parameters())), (*want, *want_params)):
            assert torch.equal(a, b) if degrees[0] == 1 else _close(a, b), degrees


class _Between(MoEHook):
    def after_dispatch(self, rows, ctx):
        return rows


def test_what_cannot_pipeline_is_an_error_for_an_explicit_degree_and_r1_for_auto(caplog):
    with pytest.raises(ConfigError, match="--moe-pipeline-degree=2: 1 or auto: the hook _Between.after_dispatch"):
        layer = _layer(pipeline_degree=2, bp_pipeline_degree=2)
        layer.register_moe_hook(_Between())
        layer.pipeline_degrees()
    layer = _layer()
    layer.register_moe_hook(_Between())
    layer.set_pipeline_degrees(2, 2)
    with caplog.at_level("INFO", logger="megatron_moe"):
        assert layer.pipeline_degrees() == (1, 1)
        assert layer.pipeline_degrees() == (1, 1)
    notes = [r.message for r in caplog.records if "auto runs r = 1" in r.message]
    assert len(notes) == 1 and "_Between.after_dispatch" in notes[0]
    with pytest.raises(ConfigError, match="--moe-bp-pipeline-degree=0: an integer >= 1"):
        layer.set_pipeline_degrees(1, 0)


@pytest.mark.parametrize("value", [0, -1, "two", 1.5])
def test_a_bad_degree_names_its_flag(value):
    with pytest.raises(ConfigError, match=f"--moe-pipeline-degree={value}"):
        MoELayerConfig(num_experts=4, hidden_size=8, ffn_hidden_size=8, pipeline_degree=value).validate()


def test_custom_experts_cannot_pipeline():
    def experts(*, num_local_experts, **_):
        return ModuleListExperts([torch.nn.Linear(H * 4, H * 4) for _ in range(num_local_experts)])

    config = TransformerConfig(
        num_layers=2, hidden_size=H * 4, ffn_hidden_size=FFN * 4, num_attention_heads=4, num_moe_experts=4,
        moe_router_topk=2, add_bias_linear=False, use_cpu_initialization=True,
    )  # fmt: skip
    moe = MoELayerConfig(num_experts=4, hidden_size=H * 4, ffn_hidden_size=FFN * 4, bp_pipeline_degree=2)
    layer = MoELayer(config, moe, experts=experts)
    with pytest.raises(
        ConfigError, match=r"--moe-bp-pipeline-degree=2: 1 or auto: custom experts \(ModuleListExperts\)"
    ):
        layer(torch.randn(4, 2, H * 4))


def _saved_bytes(fn, x) -> int:
    """Bytes of the distinct storages autograd keeps for backward while `fn(x)` runs (parameters excluded)."""
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x.detach().requires_grad_())
    return sum(seen.values())


@pytest.mark.parametrize("gated", [False, True])
def test_the_pipeline_keeps_what_the_unpipelined_experts_keep(gated):
    """x, h and a in the r = 1 layout, kept once: the same bytes for backward as the experts run whole."""
    experts, counts = _experts(gated), [5, 1, 7, 3]
    x = torch.randn(sum(counts), H)
    links = Links(None, None, None, None)
    whole = _saved_bytes(lambda t: experts(t, counts), x)
    chunked = _saved_bytes(lambda t: pipelined_experts(t, experts, counts, [counts], (4, 2), links), x)
    assert chunked == whole > sum(counts) * H * 4


def test_the_shared_expert_runs_while_chunk_0_and_the_last_dx_are_in_flight(monkeypatch):
    """Forward: chunk 0's all-to-all starts, the shared expert runs, the pipeline finishes. Backward: the pipeline's
    schedule, the shared expert's backward, then the first node waits for the last dX."""
    from megatron_moe.moe import pipeline

    order = []
    for cls, name in ((pipeline._StartPipeline, "start"), (pipeline.PipelinedExperts, "pipeline")):
        for method in ("forward", "backward"):
            original = getattr(cls, method)

            def logged(*args, _original=original, _name=f"{name}.{method}"):
                order.append(_name)
                return _original(*args)

            monkeypatch.setattr(cls, method, staticmethod(logged))
    layer = _layer(shared_expert_ffn_hidden_size=16)
    layer.set_pipeline_degrees(2, 2)
    layer.shared_expert.register_forward_hook(lambda *_: order.append("shared.forward"))
    next(layer.shared_expert.parameters()).register_hook(lambda grad: order.append("shared.backward"))
    _run(lambda t: layer(t)[0], torch.randn(6, 2, H * 4), torch.randn(6, 2, H * 4))
    assert order == [
        "start.forward",
        "shared.forward",
        "pipeline.forward",
        "pipeline.backward",
        "shared.backward",
        "start.backward",
    ]


@pytest.mark.parametrize("degrees", [(1, 1), (2, 3)])
def test_the_region_clock_brackets_dispatch_to_combine_and_changes_nothing(degrees):
    import time

    from megatron_moe.moe.hooks import RegionClock

    layer = _layer()
    layer.set_pipeline_degrees(*degrees)
    x, grad = torch.randn(6, 2, H * 4), torch.randn(6, 2, H * 4)
    want = _run(lambda t: layer(t)[0], x, grad)
    clock = RegionClock()
    layer.hooks.append(clock)
    layer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    got = _run(lambda t: layer(t)[0], x, grad)
    end = time.perf_counter()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert layer.pipeline_degrees() == degrees  # an outer hook does not stop the pipeline
    m = clock.marks
    assert start < m["forward_start"] < m["forward_end"] < m["backward_start"] < m["backward_end"] < end
    forward_ms, backward_ms = clock.region_ms()
    assert 0 < forward_ms + backward_ms < 1000.0 * (end - start)
