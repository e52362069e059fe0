"""The console's iteration line, the run's JSON-lines records and the TensorBoard event files."""

from __future__ import annotations

import logging
import math
import os
import time

from megatron_moe.platform import PeakRate, memory_in_use_bytes
from megatron_moe.training.flops import Mfu
from megatron_moe.training.log_line import COMM_FIGURES, as_json, breakdown_text, comm_record, short_line
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
        peak_flops: PeakRate | None = None,
        devices: int = 1,
        global_batch_size: int | None = None,
        validation_ppl: bool = False,
        wandb_run=None,
        log_format: str = "text",
        jsonl_path: str | None = None,
        layout: TagLayout | None = None,
    ):
        """`flops_per_step` (--log-throughput): the model FLOPs of one step over all `devices`, `peak_flops` a
        device's (`platform.peak_flops_per_s`) for MFU (`flops.Mfu`: never above 100%);
        `validation_ppl`: the validation perplexity to TensorBoard too; `wandb_run`: a wandb run that gets every
        TensorBoard scalar (`wandb_run_for`); `layout`: what can be non-zero in the run, so TensorBoard gets only
        those tags (training/tensorboard_tags.py; None: every tag). `log_format` (--log-format): "text", the short
        line, or "json", the full record, on the console; `jsonl_path`: the file each record is appended to
        (log_line.py; None: none)."""
        self.train_iters = train_iters
        self.log_interval = log_interval
        self.tokens_per_step = tokens_per_step
        self.tensorboard_log_interval = tensorboard_log_interval
        self.flops_per_step, self.devices = flops_per_step, devices
        self.mfu = Mfu(peak_flops) if peak_flops is not None else None
        self.log_format = log_format
        self.jsonl = None
        if jsonl_path:
            os.makedirs(os.path.dirname(jsonl_path) or ".", exist_ok=True)
            self.jsonl = open(jsonl_path, "a", buffering=1)  # a resumed run appends; a line is a record
            log.info(
                "log: %s line every %d iterations; each one's full record in %s (JSON lines)%s",
                "a short" if log_format == "text" else "a JSON",
                log_interval,
                jsonl_path,
                " and TensorBoard" if tensorboard_dir else "",
            )
        self._run_comm = dict.fromkeys(COMM_FIGURES, 0.0) | {"steps": 0}  # over the whole run: the closing summary
        self._run_kinds: dict[str, float] = {}
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
        memory = memory_in_use_bytes()
        record = {"iteration": iteration, "train_iters": self.train_iters}
        if self.consumed_samples is not None:
            tokens = self.consumed_samples * self.tokens_per_step // max(self.global_batch_size or 1, 1)
            record |= {"consumed_samples": self.consumed_samples, "consumed_tokens": tokens}
        record |= {"ms_per_iteration": ms_per_iter, "tokens_per_s": tokens_per_s}
        if self.flops_per_step is not None:
            tflops = self.flops_per_step * self._steps / max(elapsed, 1e-9) / self.devices / 1e12
            record["tflops_per_device"] = tflops
            if self.mfu is not None:
                record |= {"mfu_percent": self.mfu.percent(tflops * 1e12), "mfu_of": self.mfu.what}
        record |= {"eta_s": (self.train_iters - iteration) * ms_per_iter / 1000.0, "learning_rate": lr}
        if self.global_batch_size is not None:
            record["global_batch_size"] = self.global_batch_size
        record |= {name: total / self._steps for name, total in self._sums.items()}
        optional = {
            "loss_scale": self.loss_scale,
            "grad_norm": grad_norm,
            "params_norm": self._params_norm,
            "num_zeros": self._num_zeros,
        }
        record |= {name: value for name, value in optional.items() if value is not None}
        record |= {"skipped_iterations": self._skipped, "memory_bytes": memory}
        record["comm"] = comm_record(self._comm, self._kinds, self._layers)
        for name in COMM_FIGURES + ("steps",):
            self._run_comm[name] += self._comm[name]
        for kind, exposed in self._kinds.items():
            self._run_kinds[kind] = self._run_kinds.get(kind, 0.0) + exposed
        log.info("%s", short_line(record) if self.log_format == "text" else as_json(record))
        self._write(record)
        scalars = {"iteration-time": ms_per_iter / 1000.0, "tokens-per-sec": tokens_per_s, "mem-bytes": memory}
        if self.flops_per_step is not None:
            scalars["throughput"] = tflops  # TFLOP/s per device, Megatron-LM's tag
        self._scalars(scalars, iteration)
        self.dashboard.flush()
        self._reset()

    def _write(self, record: dict) -> None:
        if self.jsonl is not None:
            self.jsonl.write(as_json(record) + "\n")

    def validation(self, iteration: int, figures: dict[str, float]) -> None:
        text = " | ".join(
            f"{name}: {value:.6E} | {name} PPL: {math.exp(min(value, 20)):.3f}" for name, value in figures.items()
        )
        if self.log_format == "text":
            log.info(f"validation loss at iteration {iteration} | {text}")
        record = {"iteration": iteration, "validation": dict(figures)}
        if self.log_format == "json":
            log.info("%s", as_json(record))
        self._write(record)
        scalars = {f"{name} validation": value for name, value in figures.items()}
        if self.validation_ppl:
            scalars |= {f"{name} validation ppl": math.exp(min(v, 20)) for name, v in figures.items()}
        self._scalars(scalars, iteration)
        self.dashboard.flush()

    def close(self) -> None:
        """The run's exposed communication per kind (every kind that waited; they add up to the total), then the
        files closed."""
        if (comm := comm_record(self._run_comm, self._run_kinds, {})) is not None:
            log.info("over the run's %d timed steps, %s", self._run_comm["steps"], breakdown_text(comm))
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
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


EXPERT_SCALAR_LAYERS = 4
"""MoE layers whose tokens per expert also go to TensorBoard as one scalar per expert (the first ones; every
layer has its histogram)."""
