#!/usr/bin/env python
"""Render a training run's TensorBoard events to a one-page PNG summary, for people who don't open TensorBoard.

Four panels: the loss over steps (training, and validation where the run evaluated); the throughput
(tokens/s); each MoE layer's load per expert over steps as a heat map (tokens of the expert / the layer's mean:
1 is balanced, 0 an expert that got nothing); and the exposed communication per kind over steps, stacked (its
top is the step's total exposed communication). The tags are those docs/tensorboard.md lists
(megatron_moe/training/tensorboard_tags.py writes them).

Example:
    python -m tools.plot_run runs/gpt_moe_tiny_cpu --out summary.png
"""

from __future__ import annotations

import argparse
import os
import re
import sys

LOSS, VALIDATION = "loss/lm loss", "loss/lm loss validation"
TOKENS_PER_S = "throughput/tokens-per-sec"
EXPERT_LOAD = re.compile(r"^moe_layers/layer_(\d+)/expert_(\d+)_tokens$")
EXPOSED = re.compile(r"^comm/exposed_ms/(\w+)$")
"""The tags read here; tests/unit/test_plot_run.py checks them against tensorboard_tags.py's."""
EVENTS_PREFIX = "events.out.tfevents."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "run",
        metavar="RUN_DIR_OR_EVENT_FILE",
        help="a run's directory (its tensorboard/ is searched), a --tensorboard-dir, or one event file",
    )
    parser.add_argument("--out", default="summary.png", help="the PNG to write")
    parser.add_argument("--title", default=None, help="the page's title (%(default)s: the run's path)")
    parser.add_argument("--dpi", type=int, default=100, help="pixels per inch of the 12 x 9 inch page")
    return parser


class PlotRunError(Exception):
    """A run that cannot be plotted: the message says why and what to give instead."""


def event_source(path: str) -> str:
    """The file or directory EventAccumulator reads: `path` if it is an event file; else the one directory at
    or below `path` that holds event files (a run's resumed jobs append files to the same directory)."""
    if not os.path.exists(path):
        raise PlotRunError(f"{path} does not exist: give a run directory, a --tensorboard-dir or an event file")
    if os.path.isfile(path):
        if not os.path.basename(path).startswith(EVENTS_PREFIX):
            raise PlotRunError(f"{path} is not a TensorBoard event file ({EVENTS_PREFIX}*)")
        return path
    found = sorted({root for root, _, files in os.walk(path) for name in files if name.startswith(EVENTS_PREFIX)})
    if not found:
        raise PlotRunError(
            f"no TensorBoard event files ({EVENTS_PREFIX}*) at or below {path}: give the directory a run's "
            f"--tensorboard-dir wrote (e.g. runs/gpt_moe_tiny_cpu/tensorboard), or one of its event files"
        )
    if len(found) > 1:
        listed = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
        raise PlotRunError(f"{path} holds the events of {len(found)} runs ({listed}): give one of them")
    return found[0]


def read_scalars(source: str) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] sorted by step (a step written twice, e.g. by a resumed job: the last value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(source, size_guidance={"scalars": 0, "histograms": 1, "tensors": 1, "images": 1})
    events.Reload()
    scalars = {}
    for tag in events.Tags()["scalars"]:
        by_step = {e.step: e.value for e in events.Scalars(tag)}
        scalars[tag] = sorted(by_step.items())
    if not scalars:
        raise PlotRunError(f"{source} holds no scalars: the run wrote no step yet (TensorBoard writes at each log)")
    return scalars


def expert_loads(scalars) -> dict[int, tuple[list[int], list[list[float]]]]:
    """MoE layer -> (steps, [per expert: its load / the layer's mean load at each step])."""
    by_layer: dict[int, dict[int, dict[int, float]]] = {}
    for tag, points in scalars.items():
        match = EXPERT_LOAD.match(tag)
        if match:
            by_layer.setdefault(int(match.group(1)), {})[int(match.group(2))] = dict(points)
    loads = {}
    for layer, experts in sorted(by_layer.items()):
        steps = sorted({step for points in experts.values() for step in points})
        width = max(experts) + 1  # an expert missing from the events never got a token (held back while zero)
        rows = [[experts.get(e, {}).get(step, 0.0) for step in steps] for e in range(width)]
        means = [sum(row[i] for row in rows) / width for i in range(len(steps))]
        loads[layer] = (steps, [[v / m if m > 0 else 0.0 for v, m in zip(row, means)] for row in rows])
    return loads


def exposed_by_kind(scalars) -> dict[str, list[tuple[int, float]]]:
    return {match.group(1): points for tag, points in scalars.items() if (match := EXPOSED.match(tag))}


def _empty(ax, title: str, why: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True, transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _loss(ax, scalars) -> None:
    if LOSS not in scalars:
        return _empty(ax, "loss", f"no {LOSS!r} in the events")
    steps, values = zip(*scalars[LOSS])
    ax.plot(steps, values, label="training", color="C0")
    if VALIDATION in scalars:
        v_steps, v_values = zip(*scalars[VALIDATION])
        ax.plot(v_steps, v_values, "o-", label="validation", color="C3")
    ax.set_title(f"lm loss (last: {values[-1]:.3f} at step {steps[-1]})")
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)


def _throughput(ax, scalars) -> None:
    if TOKENS_PER_S not in scalars:
        return _empty(ax, "throughput", f"no {TOKENS_PER_S!r} in the events")
    steps, values = zip(*scalars[TOKENS_PER_S])
    ax.plot(steps, values, "o-" if len(steps) <= 50 else "-", color="C2")  # points: one per --log-interval
    ax.set_title(f"tokens/s (median {sorted(values)[len(values) // 2]:,.0f})")
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def _expert_heat_map(fig, ax, scalars) -> None:
    loads = expert_loads(scalars)
    if not loads:
        return _empty(ax, "load per expert", "no per-expert loads: not an MoE run (moe_layers/.../expert_*_tokens)")
    rows, labels, boundaries = [], [], []
    for layer, (_, layer_rows) in loads.items():
        rows += layer_rows
        labels += [f"L{layer} E{e}" for e in range(len(layer_rows))]
        boundaries.append(len(rows))
    steps = sorted({step for steps_, _ in loads.values() for step in steps_})
    # Layers logged at different steps cannot happen (one writer, one step); pad to be safe.
    rows = [row + [0.0] * (len(steps) - len(row)) for row in rows]
    top = max(2.0, max(max(row) for row in rows))
    image = ax.imshow(rows, aspect="auto", interpolation="nearest", cmap="magma", vmin=0.0, vmax=top,
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, len(rows) - 0.5, -0.5))  # fmt: skip
    for boundary in boundaries[:-1]:
        ax.axhline(boundary - 0.5, color="white", linewidth=1.5)
    every = max(1, len(labels) // 24)  # at most ~24 row labels
    ax.set_yticks(range(0, len(labels), every), labels[::every], fontsize=7)
    ax.set_xlabel("step")
    ax.set_title("load per expert (tokens / layer mean: 1 balanced, 0 idle)")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02)


def _exposed_comm(ax, scalars) -> None:
    kinds = exposed_by_kind(scalars)
    if not kinds:
        return _empty(ax, "exposed communication", "no communication in this run's layout (one rank)")
    steps = sorted({step for points in kinds.values() for step, _ in points})
    names = sorted(kinds, key=lambda k: -sum(v for _, v in kinds[k]))  # the largest at the bottom
    stacks = [[dict(kinds[k]).get(step, 0.0) for step in steps] for k in names]
    ax.stackplot(steps, stacks, labels=names, alpha=0.85)
    ax.set_title("exposed communication per kind (ms per step, stacked)")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    ax.grid(alpha=0.3)


def render(scalars, out: str, *, title: str, dpi: int = 100) -> None:
    """The page (12 x 9 inches) to `out` as PNG; matplotlib without pyplot (no display, no global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 9), layout="constrained")
    FigureCanvasAgg(fig)
    (loss, throughput), (heat, comm) = fig.subplots(2, 2, gridspec_kw={"height_ratios": [1, 1.3]})
    _loss(loss, scalars)
    _throughput(throughput, scalars)
    _expert_heat_map(fig, heat, scalars)
    _exposed_comm(comm, scalars)
    fig.suptitle(title)
    fig.savefig(out, dpi=dpi, format="png")


def main(argv: list[str] | None = None) -> str:
    """Writes the PNG; returns its path."""
    args = build_parser().parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("plot_run: needs matplotlib, which is not installed: pip install matplotlib")
    try:
        source = event_source(args.run)
        scalars = read_scalars(source)
    except PlotRunError as error:
        sys.exit(f"plot_run: {error}")
    render(scalars, args.out, title=args.title or os.path.abspath(args.run), dpi=args.dpi)
    print(f"plot_run: wrote {args.out} ({len(scalars)} tags of {source})")
    return args.out


if __name__ == "__main__":
    main()
