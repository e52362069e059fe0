"""A shared job's part (2 gloo ranks, TP=2): deferrable Column/RowParallelLinear, deferred vs not, bit for bit.

A stack of two blocks (column-parallel -> GELU -> row-parallel), two
micro-batches, with sequence parallelism (the column linear all-gathers its
input in forward and again in backward, the input gradient is reduce-scattered)
and without (the column linear's input gradient is all-reduced). Each run: our
linears with RUN_NOW (megatron-core's own code path), a deferring store that
runs each closure at once (our copy of megatron-core's function), and a store
per linear that queues the closures and runs them after both backwards, as
autograd would accumulate them. Reference: megatron-core's own linears with the
same weights. Two blocks and two micro-batches make the queued closures outlive
later backward gathers into megatron-core's shared buffer (a closure must own
its gathered input). rank 0 writes `{case: figures}` to $RESULTS.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_moe  # noqa: F401  before megatron-core: its fused functions then compile on first call

warnings.filterwarnings("ignore")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from megatron_moe.moe.weight_grad import RUN_NOW  # noqa: E402
from megatron_moe.overlap.linears import DeferrableColumnParallelLinear, DeferrableRowParallelLinear  # noqa: E402
from tests.unit.test_deferred_linears import Queue  # noqa: E402  (keeps closures; `run` sets .grad)

H, FFN, S, B, BLOCKS, MICRO_BATCHES = 16, 32, 8, 2, 2, 2


class Immediate:
    defers = True

    def put(self, weight_grad, outs):
        return weight_grad(*outs)


class Block(torch.nn.Module):
    def __init__(self, config, column_cls, row_cls, bias: bool):
        super().__init__()
        init = torch.nn.init.zeros_
        self.fc1 = column_cls(H, FFN, config=config, init_method=init, bias=bias, gather_output=False)
        self.fc2 = row_cls(FFN, H, config=config, init_method=init, bias=bias, input_is_parallel=True,
                           skip_bias_add=False)  # fmt: skip

    def forward(self, x):
        h, _ = self.fc1(x)
        out, _ = self.fc2(F.gelu(h))
        return out


def build(config, deferrable: bool, bias: bool) -> torch.nn.ModuleList:
    classes = (
        (DeferrableColumnParallelLinear, DeferrableRowParallelLinear)
        if deferrable
        else (ColumnParallelLinear, RowParallelLinear)
    )
    blocks = torch.nn.ModuleList(Block(config, *classes, bias) for _ in range(BLOCKS))
    g = torch.Generator().manual_seed(100 + parallel_state.get_tensor_model_parallel_rank())
    with torch.no_grad():
        for param in blocks.parameters():  # this rank's shards; the same in every run
            param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    return blocks


def run(blocks, micro_batches, store_kind: str | None) -> dict:
    """Outputs, input grads and parameter grads of forward+backward over the micro-batches."""
    linears = [m for block in blocks for m in (block.fc1, block.fc2)]
    queues = {}
    for linear in linears:
        if store_kind == "queue":
            linear.weight_grad_store = queues[linear] = Queue()
        elif store_kind == "immediate":
            linear.weight_grad_store = Immediate()
        elif store_kind == "run_now":
            linear.weight_grad_store = RUN_NOW
    outs, input_grads = [], []
    for x, dy in micro_batches:
        x = x.clone().requires_grad_()
        h = x
        for block in blocks:
            h = block(h)
        (h * dy).sum().backward()
        outs.append(h.detach())
        input_grads.append(x.grad)
    held = {"weight_grads_before_run": [linear.weight.grad for linear in linears]}
    for linear, queue in queues.items():
        held.setdefault("closures", []).append(len(queue.kept))
        queue.run(linear)
    grads = {name: p.grad.clone() for name, p in blocks.named_parameters()}
    return {"outs": outs, "input_grads": input_grads, "grads": grads, **held}


def compare(a: dict, b: dict) -> dict:
    """Bit-identity (and the largest difference, for the message) of two runs' tensors."""
    pairs = list(zip(a["outs"], b["outs"])) + list(zip(a["input_grads"], b["input_grads"]))
    pairs += [(a["grads"][k], b["grads"][k]) for k in a["grads"]]
    assert a["grads"].keys() == b["grads"].keys()
    return {
        "equal": all(torch.equal(x, y) for x, y in pairs),
        "max_abs_diff": max(float((x - y).abs().max()) for x, y in pairs),
        "tensors": len(pairs),
    }


def micro_batches(sequence_parallel: bool):
    g = torch.Generator().manual_seed(7)
    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    batches = []
    for _ in range(MICRO_BATCHES):
        x, dy = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
        if sequence_parallel:  # each TP rank holds its sequence shard of the input and of the output gradient
            x, dy = x.chunk(size)[rank], dy.chunk(size)[rank]
        batches.append((x, dy))
    return batches


def rank_cases() -> dict:
    results = {}
    for sequence_parallel in (True, False):
        config = TransformerConfig(
            num_layers=1, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
            tensor_model_parallel_size=2, sequence_parallel=sequence_parallel, gradient_accumulation_fusion=False,
        )  # fmt: skip
        for bias in (False, True):
            name = f"{'sp' if sequence_parallel else 'no_sp'}_{'bias' if bias else 'nobias'}"
            batches = micro_batches(sequence_parallel)
            reference = run(build(config, deferrable=False, bias=bias), batches, None)
            ours = build(config, deferrable=True, bias=bias)
            for store_kind in ("run_now", "immediate", "queue"):
                result = run(ours, batches, store_kind)
                ours.zero_grad(set_to_none=True)
                figures = compare(result, reference)
                if store_kind == "queue":
                    figures["closures"] = result["closures"]
                    figures["weight_grads_none_before_run"] = all(g is None for g in result["weight_grads_before_run"])
                results[f"{name}/{store_kind}"] = figures
    return results


def all_ranks(results: dict) -> dict:
    """Each case's figures, `equal` and the None check only when true on every rank, the largest difference."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    merged = {}
    for case in results:
        figures = dict(results[case])
        for other in gathered:
            figures["equal"] = figures["equal"] and other[case]["equal"]
            figures["max_abs_diff"] = max(figures["max_abs_diff"], other[case]["max_abs_diff"])
            if "weight_grads_none_before_run" in figures:
                figures["weight_grads_none_before_run"] &= other[case]["weight_grads_none_before_run"]
        merged[case] = figures
    return merged


def cases() -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    results = all_ranks(rank_cases())
    parallel_state.destroy_model_parallel()
    return results
