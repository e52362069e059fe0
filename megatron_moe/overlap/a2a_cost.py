"""The all-to-all's cost with message counts: linear vs Tutel's 2DH (comm/hierarchy.py), for --moe-a2a-algorithm
auto. Pure code, as cost_model.py (ms, bytes).

Legend: G = EP group size, N = nodes it spans, g = its ranks per node (G = N x g), S = bytes one rank sends.
Inputs: G, N, S and `LinkCosts` (alpha and beta per link kind, the copy rate). Outputs: `messages`, `a2a_ms`
(each algorithm's time), `crossover` (the message size below which 2DH wins), `choose` (the algorithm and why).
Model: linear posts g - 1 intra-node and G - g inter-node messages at once, t = max(intra, inter); 2DH runs its
intra-node and inter-node phases one after the other plus two stride copies. The default link figures are
assumed, not measured; the derivation and where they come from:
docs/internals/overlap.md ("The all-to-all's cost with message counts").
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
