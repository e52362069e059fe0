"""The Megatron-style console line and the TensorBoard event files."""

from __future__ import annotations

import logging
import math
import time

from megatron_moe.platform import memory_in_use_bytes

log = logging.getLogger("megatron_moe")


class TrainingLogger:
    """Accumulates step figures between log lines; rank-local, called on the logging rank."""

    def __init__(self, *, train_iters: int, log_interval: int, tokens_per_step: int, tensorboard_dir: str | None):
        self.train_iters = train_iters
        self.log_interval = log_interval
        self.tokens_per_step = tokens_per_step
        self.writer = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=100)
        self._reset()

    def _reset(self) -> None:
        self._steps = 0
        self._sums: dict[str, float] = {}
        self._skipped = 0
        self._params_norm: float | None = None
        self._comm = {"steps": 0, "step_ms": 0.0, "exposed_ms": 0.0, "comm_ms": 0.0}
        self._layers: dict[int, list[float]] = {}  # MoE layer -> [exposed ms, comm ms] over the interval
        self._kinds: dict[str, float] = {}  # "a2a" / "esp" / "dp_grad_reduce" -> exposed ms over the interval
        self._t0 = time.perf_counter()

    def step(
        self,
        iteration: int,
        figures: dict[str, float],
        *,
        lr: float,
        grad_norm: float | None,
        skipped: bool,
        tensorboard_only: dict[str, float] | None = None,
        params_norm: float | None = None,
        comm: tuple[float, float, float] | None = None,
        comm_layers: dict[int, tuple[float, float]] | None = None,
        comm_kinds: dict[str, float] | None = None,
    ) -> None:
        """`figures` go to the console line (averaged) and TensorBoard; `tensorboard_only` (e.g. the
        per-layer MoE figures) to TensorBoard alone. `params_norm` (--log-params-norm): this step's, as
        Megatron-LM shows it. `comm`: the step's (step ms, exposed comm ms, total comm ms) from the
        communication timers (None: timers off); `comm_layers`: MoE layer -> its (exposed ms, comm ms);
        `comm_kinds`: the step's exposed ms of the all-to-alls, the ESP collectives and the gradient reduction."""
        self._steps += 1
        for kind, exposed in (comm_kinds or {}).items():
            self._kinds[kind] = self._kinds.get(kind, 0.0) + exposed
        for layer, (exposed, total) in (comm_layers or {}).items():
            sums = self._layers.setdefault(layer, [0.0, 0.0])
            sums[0], sums[1] = sums[0] + exposed, sums[1] + total
        if comm is not None:
            self._comm["steps"] += 1
            for name, value in zip(("step_ms", "exposed_ms", "comm_ms"), comm):
                self._comm[name] += value
        self._params_norm = params_norm
        self._skipped += int(skipped)
        for name, value in figures.items():
            self._sums[name] = self._sums.get(name, 0.0) + value
        if self.writer:
            for name, value in {**figures, **(tensorboard_only or {})}.items():
                self.writer.add_scalar(name.replace(" ", "_"), value, iteration)
            self.writer.add_scalar("learning_rate", lr, iteration)
            if grad_norm is not None:
                self.writer.add_scalar("grad_norm", grad_norm, iteration)
            if params_norm is not None:
                self.writer.add_scalar("params-norm", params_norm, iteration)  # Megatron-LM's tag
        if iteration % self.log_interval == 0 or iteration == self.train_iters:
            self._emit(iteration, lr, grad_norm)

    def _emit(self, iteration: int, lr: float, grad_norm: float | None) -> None:
        elapsed = time.perf_counter() - self._t0
        ms_per_iter = 1000.0 * elapsed / max(self._steps, 1)
        tokens_per_s = self.tokens_per_step * self._steps / max(elapsed, 1e-9)
        eta_s = (self.train_iters - iteration) * ms_per_iter / 1000.0
        memory = memory_in_use_bytes()
        parts = [
            f"iteration {iteration:8d}/{self.train_iters:8d}",
            f"ms/iteration: {ms_per_iter:.1f}",
            f"tokens/s: {tokens_per_s:.0f}",
            f"ETA: {_hms(eta_s)}",
            f"learning rate: {lr:.3E}",
        ]
        parts += [f"{name}: {total / self._steps:.6E}" for name, total in self._sums.items()]
        if grad_norm is not None:
            parts.append(f"grad norm: {grad_norm:.4f}")
        if self._params_norm is not None:
            parts.append(f"params norm: {self._params_norm:.3f}")
        parts += [f"skipped iterations: {self._skipped}", f"memory: {memory / 2**20:.0f} MiB"]
        parts += _comm_parts(**self._comm)
        parts += _kind_parts(self._kinds, self._comm["steps"])
        if self._layers:
            hidden = (
                f"{n}: {100.0 * max(0.0, 1.0 - e / c) if c > 0 else 0.0:.0f}%"
                for n, (e, c) in sorted(self._layers.items())
            )
            parts.append("hidden by MoE layer: " + " ".join(hidden))
        log.info(" | ".join(parts))
        if self.writer:
            self.writer.add_scalar("iteration_time_ms", ms_per_iter, iteration)
            self.writer.add_scalar("tokens_per_s", tokens_per_s, iteration)
            self.writer.add_scalar("memory_bytes", memory, iteration)
            self.writer.flush()
        self._reset()

    def validation(self, iteration: int, figures: dict[str, float]) -> None:
        text = " | ".join(
            f"{name}: {value:.6E} | {name} PPL: {math.exp(min(value, 20)):.3f}" for name, value in figures.items()
        )
        log.info(f"validation loss at iteration {iteration} | {text}")
        if self.writer:
            for name, value in figures.items():
                self.writer.add_scalar(f"validation/{name.replace(' ', '_')}", value, iteration)
            self.writer.flush()

    def close(self) -> None:
        if self.writer:
            self.writer.close()


def _comm_parts(*, steps: int, step_ms: float, exposed_ms: float, comm_ms: float) -> list[str]:
    """`exposed comm: X ms (Y% of step)` (per step, over the interval) and `hidden: Z%`."""
    if steps == 0:
        return []
    share = 100.0 * exposed_ms / step_ms if step_ms > 0 else 0.0
    hidden = 100.0 * max(0.0, 1.0 - exposed_ms / comm_ms) if comm_ms > 0 else 0.0
    return [f"exposed comm: {exposed_ms / steps:.1f} ms ({share:.1f}% of step)", f"hidden: {hidden:.1f}%"]


EXPOSED_GROUPS = {"a2a": ("a2a_",), "esp": ("esp_",), "dp_grad_reduce": ("dp_grad_reduce",)}
"""The log line's exposed figures per group of timer kinds (name -> kind prefixes)."""


def exposed_by_group(exposed_ms: dict[str, float]) -> dict[str, float]:
    """A step's exposed ms per `EXPOSED_GROUPS` entry from the timers' exposed ms per kind."""
    return {
        name: sum(ms for kind, ms in exposed_ms.items() if kind.startswith(prefixes))
        for name, prefixes in EXPOSED_GROUPS.items()
    }


def _kind_parts(kinds: dict[str, float], steps: int) -> list[str]:
    """`exposed a2a / esp / dp_grad_reduce: X / Y / Z ms` (per step, over the interval), or nothing."""
    if steps == 0 or not kinds:
        return []
    names = [name for name in EXPOSED_GROUPS if name in kinds]
    values = " / ".join(f"{kinds[name] / steps:.1f}" for name in names)
    return [f"exposed {' / '.join(names)}: {values} ms"]


def _layer_parts(layers: dict[int, list[float]]) -> list[str]:
    """`hidden by MoE layer: 2: 41% 4: 57%` (each layer's all-to-alls over the interval), or nothing."""
    if not layers:
        return []
    hidden = (f"{n}: {100.0 * max(0.0, 1.0 - e / c) if c > 0 else 0.0:.0f}%" for n, (e, c) in sorted(layers.items()))
    return ["hidden by MoE layer: " + " ".join(hidden)]


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
