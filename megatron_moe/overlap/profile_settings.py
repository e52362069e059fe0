"""What the profiler measures (`profiler.py`): the MoE layer's expert work, the dense layer's work, the message
sizes, and the process groups whose traffic is timed.

Inputs: a run's layer widths (`layer_profile_settings`) or a tool's flags. Outputs: frozen `ProfileSettings`
(JSON-able: part of a saved profile's fingerprint) and `ProfileGroups`. Invariant: pure values, checked on
construction (`require`, naming the field); no collective, no tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from megatron_moe.comm.core import group_size
from megatron_moe.config.fields import require
from megatron_moe.overlap.cost_model import (
    LayerSizes,
)

KIB = 1 << 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertWork:
    """The experts whose chunk work the "gemm" lines measure: one rank's local experts and rows of one layer."""

    num_local_experts: int = 4
    """L."""
    hidden_size: int = 256
    """H."""
    ffn_hidden_size: int = 256
    """This rank's slice of one expert's width (F / P)."""
    gated: bool = False
    """SwiGLU (fc1 of width 2F)."""
    sources: int = 2
    """X = P x G: the blocks (source rank, ESP peer) whose rows each expert gets (the permutation's work)."""
    rows: tuple[int, ...] = (1024,)
    """Rows the experts compute at r = 1 (rounded down so that every (source, expert) block splits evenly)."""
    degrees: tuple[int, ...] = (1, 2, 4, 8)
    """Pipeline degrees measured on each row count: one point per degree."""

    def block_rows(self, rows: int) -> int:
        """Rows of one (source, expert) block: a multiple of every degree."""
        step = math.lcm(*self.degrees)
        return max(step, rows // (self.num_local_experts * self.sources) // step * step)

    def macs_per_row(self) -> int:
        return self.hidden_size * self.ffn_hidden_size * (3 if self.gated else 2)

    def validate(self) -> None:
        for name in ("num_local_experts", "hidden_size", "ffn_hidden_size", "sources"):
            require(getattr(self, name) >= 1, f"experts.{name}", getattr(self, name), "an integer >= 1")
        require(self.rows and min(self.rows) >= 1, "experts.rows", self.rows, "row counts >= 1, e.g. (1024,)")
        require(min(self.degrees) >= 1, "experts.degrees", self.degrees, "degrees >= 1, e.g. (1, 2, 4, 8)")
        chunks = {self.block_rows(q) // r for q in self.rows for r in self.degrees}
        require(len(chunks) >= 2, "experts", (self.rows, self.degrees), "2 or more distinct chunk sizes to fit")
        pipelined = {r for r in self.degrees if r > 1}
        require(len(pipelined) >= 2, "experts.degrees", self.degrees, "2 or more degrees > 1, e.g. (1, 2, 4, 8)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseWork:
    """The operators around the experts whose lines the partition planner needs, at one run's widths."""

    hidden_size: int = 128
    """H."""
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    """None: as many as heads."""
    ffn_hidden_size: int = 256
    """A dense layer's MLP width."""
    gated: bool = False
    """SwiGLU."""
    normalization: str = "LayerNorm"
    """"LayerNorm" or "RMSNorm" (--normalization)."""
    seq_length: int = 64
    """S: the pieces split the batch, not the sequence, so the attention's S^2 term is per sequence."""
    batches: tuple[int, ...] = (1, 2, 4)
    """Batch sizes measured: one point per size, n = batch x S / (TP under sequence parallelism)."""
    sequence_parallel: bool = False
    num_experts: int = 4
    """E: the router's width."""
    topk: int = 2
    repeats: int = 3
    """Timed calls per size after one warm-up (fewer than the collectives': these lines only rank pieces)."""

    def validate(self) -> None:
        for name in (
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "seq_length",
            "num_experts",
            "topk",
            "repeats",
        ):
            require(getattr(self, name) >= 1, f"dense.{name}", getattr(self, name), "an integer >= 1")
        distinct = len(set(self.batches)) >= 2 and min(self.batches) >= 1
        require(distinct, "dense.batches", self.batches, "2 or more distinct batch sizes >= 1, e.g. (1, 2, 4)")
        require(self.topk <= self.num_experts, "dense.topk", self.topk, f"<= num_experts = {self.num_experts}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileSettings:
    """What the micro-benchmarks measure (small enough for CPU CI by default; FSMoE used 1-24 MiB messages and
    2^19..12 x 2^19-element GEMMs, 5 runs each)."""

    comm_bytes: tuple[int, ...] = (256 * KIB, 512 * KIB, 768 * KIB, 1024 * KIB)
    """Message sizes per rank (rounded down to whole float32 elements split evenly over the group)."""
    experts: ExpertWork = ExpertWork()
    """The expert work the "gemm" lines are fitted on."""
    repeats: int = 5
    """Timed calls per size, after one warm-up call."""
    dense: DenseWork | None = None
    """The attention / dense MLP / route / unroute lines' work (None: not measured, as before those lines)."""

    def validate(self) -> None:
        require(len(set(self.comm_bytes)) >= 2, "comm_bytes", self.comm_bytes, "2 or more distinct sizes")
        require(min(self.comm_bytes) >= 64, "comm_bytes", self.comm_bytes, "sizes >= 64 bytes")
        self.experts.validate()
        require(self.repeats >= 1, "repeats", self.repeats, "an integer >= 1, e.g. 5")
        if self.dense is not None:
            self.dense.validate()

    def to_json(self) -> dict:
        """As JSON; without "dense" when None, so that a profile saved before it still describes these settings."""
        out = as_json(dataclasses.asdict(self))
        if self.dense is None:
            del out["dense"]
        return out


def layer_profile_settings(
    sizes: LayerSizes,
    *,
    hidden_size: int,
    ffn_hidden_size: int,
    num_experts: int,
    gated: bool = False,
    dense: DenseWork | None = None,
) -> ProfileSettings:
    """Micro-benchmarks at the sizes the solver asks about for one MoE layer: messages of one chunk at degrees 1,
    2, 4, 8 of the layer's all-to-all (or all-gather under ESP alone), and the pipeline's expert work on this
    rank's local experts and rows (width `ffn_hidden_size` / ESP). Used by the training set-up and
    tools/bench_pipeline.py."""
    whole = max(sizes.n_a2a, sizes.n_ag, 64 * KIB)
    comm_bytes = tuple(sorted({max(int(whole) // r, 4 * KIB) for r in (1, 2, 4, 8)}))
    width = ffn_hidden_size // sizes.esp
    rows = int(sizes.n_exp) // (hidden_size * width * (3 if gated else 2))
    experts = ExpertWork(
        num_local_experts=num_experts // sizes.ep,
        hidden_size=hidden_size,
        ffn_hidden_size=width,
        gated=gated,
        sources=sizes.ep * sizes.esp,
        rows=(max(rows, 64),),
    )
    return ProfileSettings(comm_bytes=comm_bytes, experts=experts, dense=dense)


@dataclasses.dataclass(frozen=True)
class ProfileGroups:
    """The process groups whose traffic is measured (None: the kind is not measured)."""

    ep: Any = None
    """All-to-all: the expert-model-parallel group."""
    esp: Any = None
    """All-gather / reduce-scatter: the expert-tensor-parallel (ESP) group."""
    dp: Any = None
    """Gradient all-reduce: the data-parallel group."""

    @classmethod
    def from_parallel_state(cls) -> ProfileGroups:
        """megatron-core's groups of this run (its parallel state must be initialized)."""
        from megatron.core import parallel_state as ps

        return cls(
            ep=ps.get_expert_model_parallel_group(),
            esp=ps.get_expert_tensor_parallel_group(),
            dp=ps.get_data_parallel_group(),
        )

    def sizes(self) -> dict[str, int]:
        return {name: size_of(getattr(self, name)) for name in ("ep", "esp", "dp")}


def size_of(group) -> int:
    """Ranks in a measured group; 0 for None (that kind is not measured)."""
    return 0 if group is None else group_size(group)


def as_json(value):
    """`value` as JSON reads it back (lists, not tuples): compares equal to a saved profile's."""
    return json.loads(json.dumps(value))
