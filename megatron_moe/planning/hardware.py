"""A cluster as a user describes it: GPUs (a data-sheet preset, overridable), links, and collective times on them.

GEMM rate: the preset's dense peak for the run's dtype times an achievable-efficiency curve over the GEMM's size
(FLOPs of one call; measured on one H200, interpolated in log FLOPs, flat beyond the ends); `--gemm-tflops` gives
the rate of large GEMMs instead; the `cpu` "GPU" (an emulated cluster's process) has a given, flat rate.
Links: each GPU has an intra-node link (NVLink) and an inter-node link (its NIC), Gbit/s per direction and a
start-up time per message (`alpha_ms`). Collectives over a group are costed from how it lies on the nodes
(`GroupShape`): ring all-gather / reduce-scatter / all-reduce at the slower link the ring crosses; all-to-all
linear or 2dh (Tutel's two-dimensional hierarchical).
The measured curve and the all-to-all models in full: docs/internals/planning.md.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_moe.config.fields import require

GIB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One accelerator: dense peaks from its data sheet, memory, memory bandwidth, default links."""

    name: str
    bf16_tflops: float
    """Dense (no sparsity) bf16 / fp16 tensor-core peak."""
    tf32_tflops: float
    """Dense TF32 peak (fp32 runs, where the GEMMs take TF32)."""
    fp32_tflops: float
    """Plain fp32 (no TF32)."""
    memory_gib: float
    hbm_tbps: float
    """Memory bandwidth, TB/s (the optimizer step and 2dh's copies are bound by it)."""
    intra_node_gbit: float
    """NVLink per GPU per direction, Gbit/s."""
    inter_node_gbit: float
    """The NIC per GPU per direction, Gbit/s (a common pairing, not part of the GPU's data sheet)."""
    flat_rate: bool = False
    """True: the GEMM rate does not depend on the GEMM's size (the `cpu` entry; a rate given by hand)."""


GPUS: dict[str, GpuSpec] = {
    # Data sheets: NVIDIA H100 Tensor Core GPU (SXM5), H200 (SXM), A100 80GB (SXM4), DGX/HGX B200 per GPU.
    "h100": GpuSpec(
        name="H100 SXM 80GB",
        bf16_tflops=989,
        tf32_tflops=495,
        fp32_tflops=67,
        memory_gib=80,
        hbm_tbps=3.35,
        intra_node_gbit=3600,  # NVLink 4: 900 GB/s both directions
        inter_node_gbit=400,  # ConnectX-7 NDR, one per GPU
    ),
    "h200": GpuSpec(
        name="H200 SXM 141GB",
        bf16_tflops=989,
        tf32_tflops=495,
        fp32_tflops=67,
        memory_gib=141,
        hbm_tbps=4.8,
        intra_node_gbit=3600,
        inter_node_gbit=400,
    ),
    "a100": GpuSpec(
        name="A100 SXM 80GB",
        bf16_tflops=312,
        tf32_tflops=156,
        fp32_tflops=19.5,
        memory_gib=80,
        hbm_tbps=2.04,
        intra_node_gbit=2400,  # NVLink 3: 600 GB/s both directions
        inter_node_gbit=200,  # HDR
    ),
    "b200": GpuSpec(
        name="B200 180GB",
        bf16_tflops=2250,
        tf32_tflops=1100,
        fp32_tflops=80,  # approximate: the data sheet leads with the tensor-core rates
        memory_gib=180,
        hbm_tbps=8.0,
        intra_node_gbit=7200,  # NVLink 5: 1.8 TB/s both directions
        inter_node_gbit=400,
    ),
    "cpu": GpuSpec(
        name="CPU process",
        bf16_tflops=0.0,
        tf32_tflops=0.0,
        fp32_tflops=0.0,
        memory_gib=16,
        hbm_tbps=0.02,
        intra_node_gbit=40,
        inter_node_gbit=1,
        flat_rate=True,
    ),
}

EFFICIENCY_CURVE = (  # (FLOPs of one GEMM call, achieved share of the dense bf16 peak): the H200 table above
    (2 * 1024 * 768 * 3072, 0.337),
    (2 * 4096 * 2048 * 768, 0.549),
    (2 * 256 * 4096 * 14336, 0.563),
    (2 * 512 * 4096 * 14336, 0.600),
    (2 * 1024 * 4096 * 14336, 0.650),
    (2 * 2048 * 4096 * 14336, 0.715),
    (2 * 4096 * 4096 * 14336, 0.798),
    (2 * 8192**3, 0.805),
)
BEST_EFFICIENCY = max(share for _, share in EFFICIENCY_CURVE)

INTRA_ALPHA_MS = 0.005
"""Default start-up of one message over NVLink (NCCL's intra-node point-to-point latency is a few us)."""
INTER_ALPHA_MS = 0.02
"""Default start-up of one message over the NIC (inter-node point-to-point through NCCL: ~10-30 us)."""


def efficiency_shape(flops: float) -> float:
    """The curve's share of peak at a GEMM of `flops`, relative to its best (1.0 for large GEMMs)."""
    points = EFFICIENCY_CURVE
    if flops <= points[0][0]:
        return points[0][1] / BEST_EFFICIENCY
    for (f0, e0), (f1, e1) in zip(points, points[1:]):
        if flops <= f1:
            w = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return (e0 + w * (e1 - e0)) / BEST_EFFICIENCY
    return points[-1][1] / BEST_EFFICIENCY


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compute:
    """How fast one GPU runs the model's arithmetic."""

    large_gemm_tflops: float
    """The rate of a large GEMM in the run's dtype (the curve's best share x the peak, or given)."""
    flat: bool = False
    """Every GEMM at `large_gemm_tflops`, whatever its size."""
    overhead: float = 1.25
    """Time of a layer over its GEMMs' time (norms, routing, permutes, activations, launches). Measured: our MoE
    layer at Mixtral shapes (hidden 4096, FFN 14336, 8 experts top-2, 16384 tokens, bf16) ran forward + backward
    in 40.6 ms on one H200 against a 32.5 ms floor of its GEMMs at the measured rates (1.25)."""
    hbm_tbps: float = 3.35
    host_cores: int = 0
    """0: every GPU computes on its own. Else the processes of the whole cluster share this many cores of one host
    (the `cpu` entry, an emulated cluster): `large_gemm_tflops` is a process's rate with all of them busy."""

    def busy_rate(self, processes: int, busy: int) -> float:
        """A busy process's speed-up when only `busy` of the cluster's `processes` compute, the others waiting (a
        pipeline stage in the bubble): the waiting ones give their cores to the busy ones (1.0 on GPUs)."""
        if not self.host_cores:
            return 1.0
        return min(1.0, self.host_cores / busy) / min(1.0, self.host_cores / processes)

    def gemm_ms(self, flops: float, call_flops: float | None = None) -> float:
        """ms of `flops` of GEMM work done in calls of `call_flops` each (default: one call), overhead included."""
        if flops <= 0:
            return 0.0
        rate = self.large_gemm_tflops * (1.0 if self.flat else efficiency_shape(call_flops or flops))
        return flops / (rate * 1e12) * 1e3 * self.overhead

    def memory_ms(self, nbytes: float) -> float:
        return nbytes / (self.hbm_tbps * 1e12) * 1e3


def compute_for(gpu: GpuSpec, dtype: str, gemm_tflops: float | None, overhead: float, host_cores: int = 0) -> Compute:
    """The preset's rate for `dtype` ("bf16", "fp16", "fp32"), or `gemm_tflops` where given (needed for cpu);
    `host_cores`: the cores an emulated cluster's processes share (`Compute.host_cores`, cpu only)."""
    require(dtype in ("bf16", "fp16", "fp32"), "dtype", dtype, "bf16, fp16 or fp32")
    if gemm_tflops is None:
        require(not gpu.flat_rate, "--gemm-tflops", None, f"--gpu {gpu.name} has no data sheet: give its rate")
        peak = gpu.fp32_tflops if dtype == "fp32" else gpu.bf16_tflops
        gemm_tflops = peak * BEST_EFFICIENCY
    require(gemm_tflops > 0, "--gemm-tflops", gemm_tflops, "a rate > 0 in TFLOP/s, e.g. 700")
    require(overhead >= 1.0, "--compute-overhead", overhead, "a factor >= 1, e.g. 1.25")
    require(host_cores >= 0, "--host-cores", host_cores, "the host's cores, e.g. 2 (0: each GPU its own)")
    require(not host_cores or gpu.flat_rate, "--host-cores", host_cores, "0 with a GPU preset (cpu only)")
    return Compute(
        large_gemm_tflops=gemm_tflops,
        flat=gpu.flat_rate,
        overhead=overhead,
        hbm_tbps=gpu.hbm_tbps,
        host_cores=host_cores,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    gbit: float
    """Per GPU, per direction."""
    alpha_ms: float
    """Start-up time of one message."""

    def ms(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.alpha_ms + nbytes * 8 / (self.gbit * 1e9) * 1e3


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupShape:
    """How one communication group lies on the nodes: its size, its ranks per node, the nodes it spans."""

    size: int
    per_node: int
    nodes: int

    @classmethod
    def of(cls, size: int, stride: int, gpus_per_node: int) -> GroupShape:
        """The group of `size` ranks `stride` apart from rank 0 (every group of a layout is a translate of it)."""
        node_ids = [(i * stride) // gpus_per_node for i in range(size)]
        per_node = node_ids.count(node_ids[0])
        return cls(size=size, per_node=per_node, nodes=len(set(node_ids)))

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """Lines fitted on the real cluster by tools/profile_cluster.py (`ClusterFits`), used in place of the links'
    model: (alpha ms, beta ms per byte) of its all-to-all, ESP all-gather and data-parallel all-reduce, as
    measured on its own groups (`groups`: their sizes), whatever group the layout has."""

    a2a: tuple[float, float]
    ring: tuple[float, float]
    all_reduce: tuple[float, float]
    gemm_tflops: float
    """2 FLOPs per multiply-add over the experts' fitted ms per multiply-add."""
    groups: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_fits(cls, fits) -> Measured:
        beta = fits["gemm"].beta
        require(beta > 0, "--profile", "gemm beta 0", "a profile whose experts' line has a rate (re-profile)")
        line = {kind: (max(fits[kind].alpha, 0.0), max(fits[kind].beta, 0.0)) for kind in ("a2a", "ag", "ar")}
        sizes = tuple((name, int(fits.cluster[name])) for name in ("ep", "esp", "dp") if name in fits.cluster)
        return cls(
            a2a=line["a2a"],
            ring=line["ag"],
            all_reduce=line["ar"],
            gemm_tflops=2 / (beta * 1e-3) / 1e12,
            groups=sizes,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu: GpuSpec
    intra: Link
    inter: Link
    measured: Measured | None = None
    """A profile's lines, used instead of `intra` / `inter` for the collectives (placement and algorithm then
    change nothing: the profile measured one)."""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return (
            f"{self.nodes} x {self.gpus_per_node} {self.gpu.name} ({self.world} GPUs; links {self.intra.gbit:g} Gbit/s "
            f"in a node, {self.inter.gbit:g} Gbit/s between nodes per GPU)"
        )

    def ring_line(self, group: GroupShape) -> tuple[float, float]:
        """(alpha ms, beta ms per byte) of an all-gather (n: its output on one rank) or reduce-scatter (n: its
        input) over `group`: n - 1 steps of 1 / n of the bytes over the slowest link the ring crosses."""
        n = group.size
        if n <= 1:
            return 0.0, 0.0
        if self.measured is not None:
            return self.measured.ring
        link = self.inter if group.crosses_nodes else self.intra
        return (n - 1) * link.alpha_ms, (n - 1) / n * 8 / (link.gbit * 1e9) * 1e3

    def ring_ms(self, group: GroupShape, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        alpha, beta = self.ring_line(group)
        return alpha + beta * nbytes if group.size > 1 else 0.0

    def dp_ring_ms(self, group: GroupShape, nbytes: float) -> float:
        """A data-parallel reduce-scatter or all-gather: `ring_ms`, or with a profile half its all-reduce line
        (measured over the data-parallel group; a reduce-scatter and an all-gather make an all-reduce)."""
        if self.measured is None or group.size <= 1 or nbytes <= 0:
            return self.ring_ms(group, nbytes)
        alpha, beta = self.measured.all_reduce
        return (alpha + beta * nbytes) / 2

    def p2p_ms(self, nbytes: float, across_nodes: bool) -> float:
        return (self.inter if across_nodes else self.intra).ms(nbytes)

    def a2a_line(self, group: GroupShape, algorithm: str) -> tuple[float, float]:
        """(alpha ms, beta ms per byte a rank sends) of one all-to-all over `group` (docs/internals/planning.md).

        linear: the node's peers get (per_node - 1) / n of the bytes over NVLink while the remote ones get
        (n - per_node) / n over the NIC, at once: the slower side's messages and bytes. 2dh: first (per_node - 1)
        messages carrying (per_node - 1) / per_node of the bytes over NVLink, then (nodes - 1) messages carrying
        (nodes - 1) / nodes over the NIC, one after the other, and two strided copies of the bytes in memory."""
        n, local, nodes = group.size, group.per_node, group.nodes
        if n <= 1:
            return 0.0, 0.0
        if self.measured is not None:
            return self.measured.a2a
        per_byte = {name: 8 / (link.gbit * 1e9) * 1e3 for name, link in (("intra", self.intra), ("inter", self.inter))}
        if algorithm == "linear":
            sides = [
                ((local - 1) * self.intra.alpha_ms, (local - 1) / n * per_byte["intra"]),
                ((n - local) * self.inter.alpha_ms, (n - local) / n * per_byte["inter"]),
            ]
            return max(a for a, _ in sides), max(b for _, b in sides)
        require(algorithm == "2dh", "--moe-a2a-algorithm", algorithm, "linear or 2dh")
        copies = 2 / (self.gpu.hbm_tbps * 1e12) * 1e3
        alpha = (local - 1) * self.intra.alpha_ms + (nodes - 1) * self.inter.alpha_ms
        beta = (local - 1) / local * per_byte["intra"] + (nodes - 1) / nodes * per_byte["inter"] + copies
        return alpha, beta


def build_cluster(
    *,
    nodes: int,
    gpus_per_node: int,
    gpu: str,
    memory_gib: float | None = None,
    intra_node_gbit: float | None = None,
    inter_node_gbit: float | None = None,
    intra_alpha_ms: float = INTRA_ALPHA_MS,
    inter_alpha_ms: float = INTER_ALPHA_MS,
) -> Cluster:
    """The cluster the flags describe: the preset of `gpu` with the values given on top of it."""
    require(gpu in GPUS, "--gpu", gpu, f"one of {', '.join(GPUS)}")
    require(nodes >= 1, "--nodes", nodes, "an integer >= 1, e.g. 8")
    require(gpus_per_node >= 1, "--gpus-per-node", gpus_per_node, "an integer >= 1, e.g. 8")
    spec = GPUS[gpu]
    if memory_gib is not None:
        require(memory_gib > 0, "--gpu-memory-gib", memory_gib, "a size > 0 in GiB, e.g. 80")
        spec = dataclasses.replace(spec, memory_gib=memory_gib)
    intra = spec.intra_node_gbit if intra_node_gbit is None else intra_node_gbit
    inter = spec.inter_node_gbit if inter_node_gbit is None else inter_node_gbit
    for flag, value in (("--intra-node-gbit", intra), ("--inter-node-gbit", inter)):
        require(value > 0, flag, value, "a rate > 0 in Gbit/s, e.g. 400")
    for flag, value in (("--intra-node-alpha-ms", intra_alpha_ms), ("--inter-node-alpha-ms", inter_alpha_ms)):
        require(value >= 0, flag, value, "a time >= 0 in ms, e.g. 0.01")
    return Cluster(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu=spec,
        intra=Link(gbit=intra, alpha_ms=intra_alpha_ms),
        inter=Link(gbit=inter, alpha_ms=inter_alpha_ms),
    )
