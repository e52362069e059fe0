"""The all-to-all's cost with message counts: linear vs Tutel's 2DH (comm/hierarchy.py), for --moe-a2a-algorithm
auto. Pure code, as cost_model.py (ms, bytes); that model's "a2a" line has one alpha per call, which cannot tell
the two apart: they move the same bytes across nodes and differ in how many messages carry them.

Legend: G = EP group size, N = nodes it spans, g = its ranks per node (G = N x g), S = bytes one rank sends in one
all-to-all (`LayerSizes.n_a2a`).

Per rank, a message on link kind k costs alpha_k + bytes x beta_k:
- linear: g - 1 messages of S / G inside the node and G - g across nodes, all posted at once: the two link kinds
  run side by side, t = max(intra, inter);
- 2DH: phase 2, g - 1 intra-node messages of S / g; phase 4, N - 1 inter-node messages of S / N (g chunks each);
  the phases run one after the other, with two stride copies of S: t = intra + inter + 2 S beta_copy.
The inter-node bytes are the same ((G - g) S / G = (N - 1) S / N); 2DH saves (G - g) - (N - 1) = (N - 1)(g - 1)
inter-node start-ups and pays an intra-node phase and two copies, so it wins below a message size (`crossover`)
that grows with alpha_inter and N (Tutel, Figure 20: 2DH wins at small sizes and large scale).

The defaults are assumed, not measured here (this project's emulated links have no per-message latency: no netem):
an NVLink-class node (alpha 2 us, 150 GB/s), one 200 Gbit/s NIC per GPU (25 GB/s), copies at 1 TB/s, and alpha 5 us
per inter-node message, the figure that puts 8 x 8 GPUs' crossover (28 MiB per rank) between 1 MiB, where
Tutel's Figure 20 measured 2DH faster on 64 A100s, and 32 MiB, where its NCCL implementation was slower. The model
knows no synchronisation between 2DH's phases nor the overlap of linear's start-ups inside NCCL's proxy: both make
its crossovers optimistic for 2DH. `LinkCosts` takes other figures.
"""

from __future__ import annotations

import dataclasses
import math

A2A_ALGORITHMS = ("linear", "2dh")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkCosts:
    """Per-message start-up (ms) and per-byte time (ms / byte) of the two link kinds, and the device's copy."""

    alpha_intra: float = 0.002
    beta_intra: float = 1e3 / 150e9
    alpha_inter: float = 0.005
    beta_inter: float = 1e3 / 25e9
    beta_copy: float = 1e3 / 1000e9
    """One stride copy: ms per byte of the buffer (read and written once)."""


def messages(algorithm: str, nodes: int, per_node: int) -> dict[str, int]:
    """Messages one rank sends per all-to-all on each link kind."""
    g, n = per_node, nodes
    if algorithm == "linear":
        return {"intra": g - 1, "inter": n * g - g}
    assert algorithm == "2dh", algorithm
    return {"intra": g - 1, "inter": n - 1}


def a2a_ms(algorithm: str, s_bytes: float, nodes: int, per_node: int, costs: LinkCosts = LinkCosts()) -> float:
    """Predicted time of one all-to-all in which every rank sends `s_bytes` (evenly spread over the G ranks)."""
    c, g, n = costs, per_node, nodes
    count = messages(algorithm, nodes, per_node)
    if algorithm == "linear":
        chunk = s_bytes / (n * g)
        intra = count["intra"] * (c.alpha_intra + chunk * c.beta_intra)
        inter = count["inter"] * (c.alpha_inter + chunk * c.beta_inter)
        return max(intra, inter)
    intra = count["intra"] * (c.alpha_intra + s_bytes / g * c.beta_intra) if g > 1 else 0.0
    inter = count["inter"] * (c.alpha_inter + s_bytes / n * c.beta_inter)
    copies = 2 * s_bytes * c.beta_copy if g > 1 else 0.0
    return intra + inter + copies


def crossover(nodes: int, per_node: int, costs: LinkCosts = LinkCosts()) -> float:
    """The bytes per rank S below which 2DH is predicted faster (0: never; inf: always, up to 1 TB), by bisection
    on log S (the saving shrinks as S grows: start-ups are fixed, the intra phase and copies grow with S)."""

    def gain(s: float) -> float:
        return a2a_ms("linear", s, nodes, per_node, costs) - a2a_ms("2dh", s, nodes, per_node, costs)

    low, high = 0.0, 40.0  # log2 bytes: 1 B .. 1 TB
    if gain(2**low) <= 0:
        return 0.0
    if gain(2**high) > 0:
        return math.inf
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if gain(2**mid) > 0 else (low, mid)
    return 2**low


def choose(s_bytes: float, nodes: int, per_node: int, costs: LinkCosts = LinkCosts()) -> tuple[str, str]:
    """--moe-a2a-algorithm auto: (algorithm, why), the faster of the two by `a2a_ms`; linear inside one node."""
    if nodes <= 1:
        return "linear", "the EP group lies in one node: 2DH would change nothing"
    times = {a: a2a_ms(a, s_bytes, nodes, per_node, costs) for a in A2A_ALGORITHMS}
    best = min(A2A_ALGORITHMS, key=lambda a: (times[a], a != "linear"))  # a tie: linear
    figures = ", ".join(f"{a} {t * 1e3:.0f} us" for a, t in times.items())
    return best, (
        f"{nodes} nodes x {per_node} ranks, {s_bytes / 2**10:.0f} KiB per rank: predicted {figures} "
        f"(2DH pays below {crossover(nodes, per_node, costs) / 2**10:.0f} KiB per rank)"
    )
