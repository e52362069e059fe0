"""Lancet's operator partition without a process group: its flags' errors, the pieces' order and token order, and a
gate's routing of pieces against the whole micro-batch's (the distributed equivalence: tests/distributed/
test_partition.py)."""

import pytest
import torch

from megatron_moe.config import ConfigError, MoELayerConfig, parse_args
from megatron_moe.moe.gates import build_gate
from megatron_moe.moe.pieces import batch_order, piece_sizes, run_interleaved, run_to_end

BASE = ["--data-path", "d", "--tokenizer-model", "t.model", "--num-experts", "4", "--num-layers", "4"]
BASE += ["--micro-batch-size", "4", "--global-batch-size", "8"]


def validated(*flags):
    cfg = parse_args([*BASE, *flags])
    cfg.validate(2)
    return cfg


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--moe-partition-pieces", "0"], r"--moe-partition-pieces=0: auto or an integer >= 1"),
        (["--moe-partition-pieces", "two"], r"--moe-partition-pieces=two: auto or an integer >= 1"),
        (["--moe-partition-pieces", "8"], r"--moe-partition-pieces=8: at most --micro-batch-size = 4"),
        (
            ["--moe-partition-pieces", "2", "--moe-expert-capacity-factor", "1.25"],
            r"--moe-partition-pieces=2: 1 with --moe-expert-capacity-factor 1.25: .* dropless",
        ),
        (["--moe-partition-pieces", "2", "--moe-gate", "expert_choice"], r"1 with --moe-gate expert_choice"),
        (["--moe-partition-pieces", "2", "--moe-gate", "noisy_topk"], r"1 with --moe-gate noisy_topk"),
        (["--moe-partition-pieces", "2", "--recompute-granularity", "full"], r"1 with full activation recompute"),
        (["--moe-partition-range", "3-2"], r"--moe-partition-range=3-2: 3-2: needs 1 <= FIRST <= LAST"),
        (["--moe-partition-range", "1-5"], r"LAST <= 4"),
        (["--moe-partition-range", "2-3,1-4"], r"ascending, disjoint"),
        (["--moe-partition-range", "one"], r"'one' is not FIRST-LAST; auto, all"),
        (["--moe-partition-range", "2-2", "--moe-layer-freq", "2"], r"a range with an MoE layer in it .* \[1, 3\]"),
    ],
)
def test_bad_partition_flags_name_the_flag_value_and_a_valid_choice(flags, message):
    with pytest.raises(ConfigError, match=message):
        validated(*flags)


def test_good_partition_flags_validate():
    validated("--moe-partition-pieces", "4", "--moe-partition-range", "1-2,4-4", "--recompute-modules", "router")
    validated("--moe-partition-pieces", "2", "--moe-expert-capacity-factor", "0")  # 0: dropless


def test_pieces_split_the_batch_evenly():
    assert piece_sizes(4, 2) == [2, 2]
    assert piece_sizes(5, 3) == [1, 2, 2]
    assert sum(piece_sizes(7, 7)) == 7 and min(piece_sizes(7, 7)) == 1


def test_pieces_run_stage_by_stage_in_piece_order():
    """Lancet 5.3: each piece runs until it yields; stages ordered by piece index."""
    trace = []

    def piece(i):
        trace.append(f"A{i}")
        yield
        trace.append(f"B{i}")
        yield
        trace.append(f"C{i}")
        return i * 10

    assert run_interleaved([piece(i) for i in range(3)]) == [0, 10, 20]
    assert trace == ["A0", "A1", "A2", "B0", "B1", "B2", "C0", "C1", "C2"]
    assert run_to_end(piece(4)) == 40


def test_batch_order_puts_the_pieces_tokens_back_in_the_micro_batch_order():
    s, b, h = 3, 5, 2
    x_SBH = torch.arange(s * b * h, dtype=torch.float32).view(s, b, h)
    sizes = piece_sizes(b, 2)
    pieces = torch.split(x_SBH, sizes, dim=1)
    parts_T = [piece.reshape(-1, h) for piece in pieces]
    assert torch.equal(batch_order(parts_T, [p.shape for p in pieces]), x_SBH.reshape(-1, h))
    assert batch_order([None, None], [p.shape for p in pieces]) is None


@pytest.mark.parametrize("gate", ["topk", "sigmoid", "cosine"])
def test_the_pieces_routing_gives_the_micro_batch_losses(gate):
    torch.manual_seed(0)
    cfg = MoELayerConfig(num_experts=4, hidden_size=8, ffn_hidden_size=16, topk=2, gate=gate, z_loss_coeff=1e-3)
    router = build_gate(cfg)
    # Each piece's scores are 16 tokens x 4 experts = 64 floats: a CPU's element-wise kernels compute the elements
    # past a tensor's last whole vector block (32 floats under AVX-512) with their scalar code, whose sigmoid and
    # exp round otherwise; on whole blocks every element takes the vector code, as on a GPU every element takes
    # the same code, so the pieces' scores are the whole's to the bit.
    s, b = 8, 4
    x_SBH = torch.randn(s, b, 8)
    whole = router(x_SBH.reshape(-1, 8))
    pieces = torch.split(x_SBH, piece_sizes(b, 2), dim=1)
    with router.losses_later():
        routed = [(router(piece.reshape(-1, 8)), None, piece.shape) for piece in pieces]
    assert all(r.aux_loss is None and not r.losses for r, _, _ in routed)  # left for the micro-batch
    batch = router.batch_routing(routed)
    assert batch.num_tokens == whole.num_tokens
    assert torch.equal(batch.probs_TE, whole.probs_TE)
    assert torch.equal(batch.aux_loss, whole.aux_loss)
    assert batch.losses.keys() == whole.losses.keys()
    for name, value in whole.losses.items():
        assert torch.equal(batch.losses[name], value), name


def test_a_gate_that_routes_with_the_batch_refuses_pieces():
    cfg = MoELayerConfig(num_experts=4, hidden_size=8, ffn_hidden_size=16, topk=2, gate="topk", capacity_factor=1.0)
    router = build_gate(cfg)
    assert not router.routes_pieces
    with pytest.raises(TypeError, match="cannot route a piece"), router.losses_later():
        pass


def test_the_block_probe_reads_megatron_cores_methods(monkeypatch):
    from megatron_moe.model import partition

    (probe,) = partition.PROBES
    assert probe.still_needed()
    monkeypatch.setitem(partition.UPSTREAM_SHA256, "TransformerLayer._forward_mlp", "0" * 64)
    assert not probe.still_needed()


class _Logged(torch.autograd.Function):
    """Identity whose backward writes `name` to `trace`."""

    @staticmethod
    def forward(ctx, x, trace, name):
        ctx.trace, ctx.name = trace, name
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.trace.append(ctx.name)
        return grad, None, None


class _Trace:
    """A comm Monitor writing each collective's issue and wait to `trace`."""

    def __init__(self, trace):
        self.trace = trace

    def issued(self, collective):
        self.trace.append(f"issued {collective.purpose}{' backward' if collective.backward else ''}")
        return collective

    def handle(self, token, work):
        pass

    def blocked(self, token):
        pass

    def unblocked(self, token, *, completed):
        if not completed:
            return
        self.trace.append(f"done {token.purpose}{' backward' if token.backward else ''}")

    def read_started(self, read):
        pass

    def read_ended(self, token):
        pass


def test_the_reverse_all_to_all_is_in_flight_under_what_the_forward_ran_in_flight(megatron_world1):
    """The backward mirrors the forward: the reverse starts where the forward waited for the rows, and the work made
    between the forward's start and wait (a piece's attention, the shared expert) runs before it is waited."""
    import torch.distributed as dist

    from megatron_moe import comm

    trace = []
    x = torch.randn(4, 3, requires_grad=True)
    other = torch.randn(4, 3, requires_grad=True)
    with comm.monitoring(_Trace(trace)):
        handle = comm.dispatch_all_to_all(x, [4], [4], dist.group.WORLD)
        between = _Logged.apply(other, trace, "work between start and wait")
        rows = handle.wait()
        trace.append("forward done")
        (_Logged.apply(rows, trace, "work after the wait") * between).sum().backward()
    backward = trace[trace.index("forward done") + 1 :]
    assert backward.index("issued dispatch_all_to_all backward") < backward.index("work between start and wait")
    assert backward.index("work between start and wait") < len(backward) - 1
    assert torch.equal(x.grad, other.detach())  # the gradient went through the reverse all-to-all
