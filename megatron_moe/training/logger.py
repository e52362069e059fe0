"""The Megatron-style console line and the TensorBoard event files."""

from __future__ import annotations

import logging
import math
import os
import time

from megatron_moe.comm.timers import hidden_share
from megatron_moe.platform import memory_in_use_bytes
from megatron_moe.training.tensorboard_tags import Dashboard, TagLayout

log = logging.getLogger("megatron_moe")


class TrainingLogger:
    """Accumulates step figures between log lines; rank-local, called on the logging rank."""

    def __init__(
        self,
        *,
        train_iters: int,
        log_interval: int,
        tokens_per_step: int,
        tensorboard_dir: str | None,
        tensorboard_log_interval: int = 1,
        flops_per_step: float | None = None,
        peak_flops: tuple[float, str] | None = None,
        devices: int = 1,
        global_batch_size: int | None = None,
        validation_ppl: bool = False,
        wandb_run=None,
        layout: TagLayout | None = None,
    ):
        """`flops_per_step` (--log-throughput): the model FLOPs of one step over all `devices`, `peak_flops` a
        device's (FLOP/s, what it is: `platform.peak_flops_per_s`) for MFU;
        `validation_ppl`: the validation perplexity to TensorBoard too; `wandb_run`: a wandb run that gets every
        TensorBoard scalar (`wandb_run_for`); `layout`: what can be non-zero in the run, so TensorBoard gets only
        those tags (training/tensorboard_tags.py; None: every tag)."""
        self.train_iters = train_iters
        self.log_interval = log_interval
        self.tokens_per_step = tokens_per_step
        self.tensorboard_log_interval = tensorboard_log_interval
        self.flops_per_step, self.peak_flops, self.devices = flops_per_step, peak_flops, devices
        self.global_batch_size = global_batch_size
        self.consumed_samples: int | None = None
        self.loss_scale: float | None = None
        self.validation_ppl = validation_ppl
        writer = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=100)
        self.dashboard = Dashboard(writer, layout=layout, wandb_run=wandb_run)
        self._reset()

    def _scalars(self, values: dict[str, float], iteration: int) -> None:
        """To TensorBoard (grouped, the loss and optimizer tags also against the consumed samples) and to wandb,
        where each is on: training/tensorboard_tags.py."""
        self.dashboard.scalars(values, iteration, self.consumed_samples)

    def _expert_loads(self, expert_counts: dict[int, list[float]], iteration: int) -> None:
        """Tokens per expert of each MoE layer: a histogram per layer (the experts' loads), and a scalar per expert
        for the first `EXPERT_SCALAR_LAYERS` MoE layers."""
        self.dashboard.expert_loads(expert_counts, iteration, scalar_layers=EXPERT_SCALAR_LAYERS)

    def _reset(self) -> None:
        self._steps = 0
        self._sums: dict[str, float] = {}
        self._skipped = 0
        self._params_norm: float | None = None
        self._num_zeros: int | None = None
        self._comm = dict.fromkeys(COMM_FIGURES, 0.0) | {"steps": 0}
        self._layers: dict[int, list[float]] = {}  # MoE layer -> [exposed ms, wire ms] over the interval
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
        comm: tuple[float, float, float, float, float] | None = None,
        comm_layers: dict[int, tuple[float, float]] | None = None,
        comm_kinds: dict[str, float] | None = None,
        num_zeros: int | None = None,
        consumed_samples: int | None = None,
        loss_scale: float | None = None,
        expert_counts: dict[int, list[float]] | None = None,
    ) -> None:
        """`figures` go to the console line (averaged) and TensorBoard; `tensorboard_only` (e.g. the
        per-layer MoE figures) to TensorBoard alone. `params_norm` (--log-params-norm): this step's, as
        Megatron-LM shows it. `comm`: the step's (step ms, exposed comm ms, wire ms, skew ms, transfer ms) from
        the communication timers (`COMM_FIGURES`; None: timers off); `comm_layers`: MoE layer -> its (exposed ms,
        wire ms); `comm_kinds`: the step's exposed ms of the all-to-alls, the ESP collectives and the gradient
        reduction; `num_zeros` (--log-num-zeros-in-grad): the step's zero gradient entries; `consumed_samples` after the
        step; `loss_scale` (fp16's); `expert_counts`: each MoE layer's tokens per expert over the step."""
        self._steps += 1
        for kind, exposed in (comm_kinds or {}).items():
            self._kinds[kind] = self._kinds.get(kind, 0.0) + exposed
        for layer, (exposed, wire) in (comm_layers or {}).items():
            sums = self._layers.setdefault(layer, [0.0, 0.0])
            sums[0], sums[1] = sums[0] + exposed, sums[1] + wire
        if comm is not None:
            self._comm["steps"] += 1
            for name, value in zip(COMM_FIGURES, comm, strict=True):
                self._comm[name] += value
        self._params_norm = params_norm
        self._skipped += int(skipped)
        for name, value in figures.items():
            self._sums[name] = self._sums.get(name, 0.0) + value
        if num_zeros is not None:
            self._num_zeros = num_zeros
        self.consumed_samples, self.loss_scale = consumed_samples, loss_scale
        if iteration % self.tensorboard_log_interval == 0:
            # Megatron-LM's names where the quantity is the same, grouped into tags by tensorboard_tags.tag_of
            scalars = {**figures, **(tensorboard_only or {}), "learning-rate": lr}
            if self.global_batch_size is not None:
                scalars["batch-size"] = self.global_batch_size
            optional = {"grad-norm": grad_norm, "params-norm": params_norm, "num-zeros": num_zeros}
            scalars |= {tag: value for tag, value in optional.items() if value is not None}
            if loss_scale is not None:
                scalars["loss-scale"] = loss_scale
            self._scalars(scalars, iteration)
            self._expert_loads(expert_counts or {}, iteration)
        if iteration % self.log_interval == 0 or iteration == self.train_iters:
            self._emit(iteration, lr, grad_norm)

    def _emit(self, iteration: int, lr: float, grad_norm: float | None) -> None:
        elapsed = time.perf_counter() - self._t0
        ms_per_iter = 1000.0 * elapsed / max(self._steps, 1)
        tokens_per_s = self.tokens_per_step * self._steps / max(elapsed, 1e-9)
        eta_s = (self.train_iters - iteration) * ms_per_iter / 1000.0
        memory = memory_in_use_bytes()
        parts = [f"iteration {iteration:8d}/{self.train_iters:8d}"]
        if self.consumed_samples is not None:
            tokens = self.consumed_samples * self.tokens_per_step // max(self.global_batch_size or 1, 1)
            parts += [f"consumed samples: {self.consumed_samples:d}", f"consumed tokens: {tokens:d}"]
        parts += [f"ms/iteration: {ms_per_iter:.1f}", f"tokens/s: {tokens_per_s:.0f}"]
        if self.flops_per_step is not None:
            tflops = self.flops_per_step * self._steps / max(elapsed, 1e-9) / self.devices / 1e12
            parts.append(f"throughput per device: {tflops:.3f} TFLOP/s")
            if self.peak_flops is not None:
                peak, what = self.peak_flops
                parts.append(f"MFU: {100.0 * tflops * 1e12 / peak:.1f}% (of the {what})")
        parts += [f"ETA: {_hms(eta_s)}", f"learning rate: {lr:.3E}"]
        if self.global_batch_size is not None:
            parts.append(f"global batch size: {self.global_batch_size:d}")
        parts += [_figure(name, total / self._steps) for name, total in self._sums.items()]
        if self.loss_scale is not None:
            parts.append(f"loss scale: {self.loss_scale:.1f}")
        if grad_norm is not None:
            parts.append(f"grad norm: {grad_norm:.4f}")
        if self._params_norm is not None:
            parts.append(f"params norm: {self._params_norm:.3f}")
        if self._num_zeros is not None:
            parts.append(f"num zeros: {self._num_zeros}")
        parts += [f"skipped iterations: {self._skipped}", f"memory: {memory / 2**20:.0f} MiB"]
        parts += _comm_parts(**self._comm)
        parts += _kind_parts(self._kinds, self._comm["steps"])
        parts += _layer_parts(self._layers)
        log.info(" | ".join(parts))
        scalars = {"iteration-time": ms_per_iter / 1000.0, "tokens-per-sec": tokens_per_s, "mem-bytes": memory}
        if self.flops_per_step is not None:
            scalars["throughput"] = tflops  # TFLOP/s per device, Megatron-LM's tag
        self._scalars(scalars, iteration)
        self.dashboard.flush()
        self._reset()

    def validation(self, iteration: int, figures: dict[str, float]) -> None:
        text = " | ".join(
            f"{name}: {value:.6E} | {name} PPL: {math.exp(min(value, 20)):.3f}" for name, value in figures.items()
        )
        log.info(f"validation loss at iteration {iteration} | {text}")
        scalars = {f"{name} validation": value for name, value in figures.items()}
        if self.validation_ppl:
            scalars |= {f"{name} validation ppl": math.exp(min(v, 20)) for name, v in figures.items()}
        self._scalars(scalars, iteration)
        self.dashboard.flush()

    def close(self) -> None:
        self.dashboard.close()


def wandb_run_for(project: str | None, name: str | None, save_dir: str | None, config: dict):
    """A wandb run for --wandb-project (None without it); offline with WANDB_MODE=offline, as wandb reads it."""
    if project is None:
        return None
    try:
        import wandb
    except ImportError as error:
        from megatron_moe.config import ConfigError

        raise ConfigError(
            f"--wandb-project={project}: needs the wandb package, which is not installed (pip install wandb; "
            f"WANDB_MODE=offline logs without an account), or drop --wandb-project"
        ) from error
    os.makedirs(save_dir, exist_ok=True)
    return wandb.init(project=project, name=name, dir=save_dir, config=config)


def _figure(name: str, value: float) -> str:
    """A loss as Megatron-LM shows it (6 significant digits, E-notation); a ratio or other figure as a plain
    decimal (a count would be printed as an integer by its caller)."""
    return f"{name}: {value:.6E}" if "loss" in name else f"{name}: {value:.4f}"


def _comm_parts(
    *, steps: int, step_ms: float, exposed_ms: float, wire_ms: float, skew_ms: float, transfer_ms: float
) -> list[str]:
    """`exposed comm: X ms (Y% of step)`, `of it skew / transfer: S / T ms` (waiting for the last rank to arrive,
    then for the bytes) and `on the wire: V ms` (per step, over the interval), and `hidden: Z%` of all
    communication: 1 - exposed / wire (comm/timers.py)."""
    if steps == 0:
        return []
    share = 100.0 * exposed_ms / step_ms if step_ms > 0 else 0.0
    return [
        f"exposed comm: {exposed_ms / steps:.1f} ms ({share:.1f}% of step)",
        f"of it skew / transfer: {skew_ms / steps:.1f} / {transfer_ms / steps:.1f} ms",
        f"on the wire: {wire_ms / steps:.1f} ms",
        f"hidden: {100.0 * hidden_share(exposed_ms, wire_ms):.1f}%",
    ]


COMM_FIGURES = ("step_ms", "exposed_ms", "wire_ms", "skew_ms", "transfer_ms")
"""The communication timers' figures a step gives the log line (`TrainingLogger.step`'s `comm`), in order."""
EXPERT_SCALAR_LAYERS = 4
"""MoE layers whose tokens per expert also go to TensorBoard as one scalar per expert (the first ones; every
layer has its histogram)."""
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
    """`hidden by MoE layer: 2: 41% 4: 57%` (each layer's all-to-alls over the interval, 1 - exposed / wire), or
    nothing."""
    if not layers:
        return []
    hidden = (f"{n}: {100.0 * hidden_share(e, w):.0f}%" for n, (e, w) in sorted(layers.items()))
    return ["hidden by MoE layer: " + " ".join(hidden)]


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
