"""The run's parallel layout: the degrees, every group size derived from them, and their checks, in one place.

`ParallelDims` (after torchtitan's parallel_dims.py) is built from the parallel flags and the world size
(`ParallelDims.from_config`, or `RunConfig.dims(world_size)`): tp, pp, cp, ep, esp (--expert-tensor-parallel-size,
unset = 1 here), vpp, and derived as megatron-core 0.16.1 derives them, `dp` = world / (tp x pp x cp) and
`expert_dp` = world / (pp x ep x esp). Code that needs a group size asks it instead of multiplying flags.
The flag -> field -> megatron-core argument table: docs/internals/config.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from megatron_moe.config.fields import require

if TYPE_CHECKING:
    from megatron_moe.config.groups import ParallelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The degrees of one layout on `world` ranks; the derived sizes are properties."""

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    esp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False

    @classmethod
    def from_config(
        cls,
        parallel: ParallelConfig,
        world_size: int | None = None,
        num_layers: int | None = None,
        *,
        data_parallel_size: int | None = None,
    ) -> ParallelDims:
        """The layout the flags of `parallel` describe on `world_size` ranks; or on `data_parallel_size` x
        (tp x pp x cp) ranks; or, given neither, on the fewest ranks that hold it (`smallest_world`: enough for
        the sizes that do not depend on the data-parallel size). `num_layers`: for `vpp` (None without it);
        leave it out where the flags are not checked yet (`ParallelConfig.virtual_pipeline_size` divides by
        them)."""
        if world_size is not None and data_parallel_size is not None:
            raise TypeError("ParallelDims.from_config: give world_size or data_parallel_size, not both")
        dims = cls(
            world=0,
            tp=parallel.tensor_model_parallel_size,
            pp=parallel.pipeline_model_parallel_size,
            cp=parallel.context_parallel_size,
            ep=parallel.expert_model_parallel_size,
            esp=parallel.expert_tensor_parallel,
            vpp=None if num_layers is None else parallel.virtual_pipeline_size(num_layers),
            sequence_parallel=parallel.sequence_parallel,
        )
        if world_size is None:
            world_size = dims.smallest_world if data_parallel_size is None else data_parallel_size * dims.replica_size
        return dataclasses.replace(dims, world=world_size)

    @property
    def replica_size(self) -> int:
        """Ranks of one data-parallel replica: tp x pp x cp (megatron-core's model_size; its model-parallel group,
        tp x pp, leaves cp out)."""
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: world / (tp x pp x cp) (megatron-core's data_parallel_size)."""
        return self.world // self.replica_size

    @property
    def ranks_per_stage(self) -> int:
        """Ranks of one pipeline stage: world / pp (= tp x cp x dp = ep x esp x expert_dp)."""
        return self.world // self.pp

    @property
    def expert_shards(self) -> int:
        """Ranks one MoE layer's experts are split over: ep x esp (megatron-core's tp-ep group)."""
        return self.ep * self.esp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel ranks: world / (pp x ep x esp) (megatron-core's expert_data_parallel_size)."""
        return self.ranks_per_stage // self.expert_shards

    @property
    def sequence_split(self) -> int:
        """Shards of the sequence outside attention: tp under --sequence-parallel, else 1."""
        return self.tp if self.sequence_parallel else 1

    @property
    def token_split(self) -> int:
        """Shards of a micro-batch's tokens at the MoE layer: (tp under --sequence-parallel) x cp."""
        return self.sequence_split * self.cp

    @property
    def smallest_world(self) -> int:
        """The fewest ranks that hold the layout: world % (tp x pp x cp) == 0 and (world / pp) % (ep x esp) == 0."""
        return self.pp * math.lcm(self.tp * self.cp, self.expert_shards)

    def check_degrees(self) -> None:
        """Every degree is at least 1."""
        for flag, value in [
            ("--tensor-model-parallel-size", self.tp),
            ("--pipeline-model-parallel-size", self.pp),
            ("--expert-model-parallel-size", self.ep),
            ("--context-parallel-size", self.cp),
            ("--expert-tensor-parallel-size", self.esp),
        ]:
            require(value >= 1, flag, value, "must be >= 1")

    def check_world(self) -> None:
        """The world splits into whole tp x pp x cp model replicas."""
        tp, pp, cp, mp = self.tp, self.pp, self.cp, self.replica_size
        require(
            self.world % mp == 0,
            "world size",
            self.world,
            f"must be a multiple of TP x PP x CP = {tp} x {pp} x {cp} = {mp}; "
            f"valid world sizes are multiples of {mp}, or change the parallel sizes",
        )

    def check_expert_layout(self) -> None:
        """ep x esp divides the ranks of a pipeline stage (megatron-core's expert RankGenerator needs it)."""
        require(
            self.ranks_per_stage % self.expert_shards == 0,
            "--expert-model-parallel-size",
            self.ep,
            f"EP x expert-TP = {self.expert_shards} must divide the ranks per pipeline stage "
            f"({self.ranks_per_stage} = world {self.world} / PP {self.pp})",
        )

    def validate(self) -> None:
        """The degrees themselves: each >= 1, whole model replicas, whole expert groups per pipeline stage."""
        self.check_degrees()
        self.check_world()
        self.check_expert_layout()
