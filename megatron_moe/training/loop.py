"""The training loop: steps, validation, logging and checkpoints."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_model_config, unwrap_model

from megatron_moe import comm
from megatron_moe.checkpointing import TrainState, save_checkpoint
from megatron_moe.comm.skew import Arrivals, ClockOffset, estimate_clock_offset
from megatron_moe.comm.timers import CommTimers
from megatron_moe.config import RunConfig
from megatron_moe.failure import ONCE
from megatron_moe.model.builder import params_dtype
from megatron_moe.moe import collect_moe_metrics, finish_router_step, set_moe_aux_loss_scale
from megatron_moe.moe.metrics import moe_layer_modules
from megatron_moe.overlap import batch
from megatron_moe.overlap.runtime import OverlapRuntime
from megatron_moe.platform import peak_flops_per_s
from megatron_moe.platform.timing import comm_stamps
from megatron_moe.training.comm_report import (
    HiddenCheck,
    layer_exposed_and_wire,
    tensorboard_scalars,
    wgrad_report,
    wire_lines,
)
from megatron_moe.training.divergence import ForwardFiniteFlags, LossSpikeDetector, check_grads_then, check_loss
from megatron_moe.training.flops import flops_per_token
from megatron_moe.training.log_line import exposed_by_group, jsonl_path
from megatron_moe.training.logger import TrainingLogger, wandb_run_for
from megatron_moe.training.moe_metrics import BALANCING_NAMES, pop_moe_aux_losses
from megatron_moe.training.mtp_metrics import clear_mtp_losses, pop_mtp_losses
from megatron_moe.training.optimizer import params_norm
from megatron_moe.training.overlap_report import OverlapReport
from megatron_moe.training.overlap_report import as_text as overlap_report_text
from megatron_moe.training.preemption import ExitRequest, StopSignals
from megatron_moe.training.step import forward_step
from megatron_moe.training.tensorboard_tags import TagLayout

log = logging.getLogger("megatron_moe")

# Test-only fault injection: "RANK:STEP" makes that rank raise at the start of that step (tests/distributed).
RAISE_AT_ENV = "MEGATRON_MOE_TEST_RAISE_AT"


# Test-only: "RANK:STEP" makes that rank's embedding output NaN in that step (tests/faults/test_ranks.py).
NAN_AT_ENV = "MEGATRON_MOE_TEST_NAN_AT"


def injected_failure_step(rank: int, env: str = RAISE_AT_ENV) -> int | None:
    """The step at which this rank raises (or, `env=NAN_AT_ENV`, goes NaN) from $env (None: no injection)."""
    spec = os.environ.get(env)
    if not spec:
        return None
    target_rank, step = (int(part) for part in spec.split(":"))
    return step if target_rank == rank else None


def _nan_output(module, inputs, output):
    return output * float("nan")


def computed_losses_only(figures: dict[str, float], *, aux: bool, z: bool) -> dict[str, float]:
    """Leave a router loss that is not computed out of the log (aggregate and per layer), not shown as 0."""
    dropped = (() if aux else ("moe aux loss", "/aux_loss")) + (() if z else ("moe z loss", "/z_loss"))
    return {k: v for k, v in figures.items() if not any(k == d or k.endswith(d) for d in dropped)}


def _reduce_lm_loss(losses_reduced: list[dict]) -> float | None:
    """Mean token loss of the step over all DP ranks (None off the last stage)."""
    if not parallel_state.is_pipeline_last_stage():
        return None
    total = torch.stack([d["lm loss"] for d in losses_reduced]).sum(dim=0).float()
    comm.reduce_lm_loss(total, parallel_state.get_data_parallel_group(with_context_parallel=True))
    with comm.host_read("lm loss"):
        return (total[0] / total[1]).item()


class Trainer:
    """Owns the model, optimizer and data iterators of one run."""

    def __init__(
        self,
        cfg: RunConfig,
        model,
        optimizer,
        scheduler,
        state: TrainState,
        data,
        *,
        watchdog=None,
        startup: dict | None = None,
        overlap: OverlapRuntime | None = None,
        signals: StopSignals | None = None,
    ):
        self.cfg = cfg
        self.signals = signals  # preemption.StopSignals, installed by `pretrain` (None: signals keep their defaults)
        # The run's overlap runtime (Lancet's queue, the gradient-reduce launcher, the plans and fits); the model's
        # dispatchers hold the same object. None: nothing overlapped (a runtime with every feature off).
        self.overlap = overlap if overlap is not None else OverlapRuntime()
        self.startup = startup  # the start-up summary's figures (parameters, datasets, tokenizer): first entry only
        self.watchdog = watchdog  # comm.watchdog.Watchdog: told the step, which its reports name
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.state = state
        self.data = data  # megatron_moe.training.data.RunData
        self.world = dist.get_world_size()
        self.num_microbatches = cfg.num_microbatches(self.world)
        self.forward_backward = batch.schedule(cfg, get_model_config(model[0]), self.num_microbatches)
        self.num_moe_layers = cfg.moe.moe_layer_count(cfg.model)  # the MTP layers' MoE included
        self.own_moe = cfg.moe.own_layer
        # Router losses the MoE layers compute: only those are logged (a loss not computed is not a 0).
        self.logged_losses = cfg.moe.logged_router_losses(cfg.model)
        self.rank = dist.get_rank()
        self.logging_rank = self.world - 1  # a last-stage rank
        self.is_logging_rank = self.rank == self.logging_rank
        self._raise_at = injected_failure_step(self.rank)
        self._nan_at = injected_failure_step(self.rank, NAN_AT_ENV)
        self.check_finite = not cfg.training.fp16  # fp16: the loss scaler handles inf/NaN (skips the step)
        self.forward_flags = ForwardFiniteFlags(model) if self.check_finite else None
        if self.check_finite:  # every rank checks its local grads before they are reduced
            config = get_model_config(model[0])
            config.finalize_model_grads_func = check_grads_then(
                config.finalize_model_grads_func,
                iteration=lambda: self.state.iteration + 1,
                rank=self.rank,
                world_size=self.world,
                origin=self.forward_flags.describe,
                forward_nonfinite=self.forward_flags.any,
            )
        self.spikes = LossSpikeDetector(
            factor=cfg.logging.loss_spike_factor,
            window=cfg.logging.loss_spike_window,
            initial=math.log(unwrap_model(model[0]).vocab_size),  # padded: the output layer's width
        )
        self._validated_at = None
        self._validation_losses: dict[int, float] = {}  # iteration -> validation lm loss (logging rank): history
        self._expert_counts: dict[int, list[float]] = {}  # the step's tokens per expert per MoE layer (our layer)
        self._degrees_logged = False
        # Always on (--no-comm-timers only to measure their cost): reset at each step start, read at its end.
        # On the logging rank only: its history and log line are the only readers, so elsewhere they would
        # be per-collective work (and on GPU an event wait per step) that nothing uses. The other ranks stamp
        # their arrival at each MoE collective (`Arrivals`), exchanged with the logging rank's EP groups after
        # the step: its skew is measured (comm/skew.py).
        timers_on = not cfg.logging.no_comm_timers
        timed = self.is_logging_rank and timers_on
        clock_offset = self._clock_offset() if timers_on else ClockOffset()
        # The cost model's fits (None when no choice needed them): the link's time for the bytes that cross, the
        # denominator of the hidden share (comm/timers.py); without them the timers estimate it.
        self.comm_timers = (
            CommTimers(wire_lines=wire_lines(self.overlap.fits), clock_offset=clock_offset) if timed else None
        )
        self.arrivals: Arrivals | None = None
        if timers_on:
            self.arrivals = self.comm_timers.arrivals if timed else Arrivals(comm_stamps(), clock_offset)
        self.hidden_check = HiddenCheck(cfg) if timed else None
        self.overlap_report = None  # --overlap-report: the planners' predictions beside the timers' figures
        if timed and cfg.moe.is_moe and cfg.moe.overlap_report:
            job_steps = cfg.training.train_iters - state.iteration
            self.overlap_report = OverlapReport(
                self.overlap.plans, job_steps=job_steps, micro_batches=self.num_microbatches
            )
        self.logger = None
        if self.is_logging_rank:
            lg = cfg.logging
            tokens_per_step = cfg.training.global_batch_size * cfg.model.seq_length
            vocab = unwrap_model(model[0]).vocab_size  # padded: the output layer's width
            self.logger = TrainingLogger(
                train_iters=cfg.training.train_iters,
                log_interval=lg.log_interval,
                tokens_per_step=tokens_per_step,
                tensorboard_dir=lg.tensorboard_dir,
                tensorboard_log_interval=lg.tensorboard_log_interval,
                flops_per_step=flops_per_token(cfg, vocab) * tokens_per_step if lg.log_throughput else None,
                peak_flops=peak_flops_per_s(params_dtype(cfg)) if lg.log_throughput else None,
                devices=self.world,
                global_batch_size=cfg.training.global_batch_size,
                validation_ppl=lg.log_validation_ppl_to_tensorboard,
                wandb_run=wandb_run_for(
                    lg.wandb_project,
                    lg.wandb_exp_name,
                    lg.wandb_save_dir or os.path.join(cfg.checkpoint.save or ".", "wandb"),
                    cfg.to_dict(),
                ),
                log_format=lg.log_format,
                jsonl_path=jsonl_path(lg.tensorboard_dir),
                layout=TagLayout.of(cfg, self.world),
            )

    def _run_microbatches(self, data_iterator, *, forward_only: bool) -> list[dict]:
        seq = self.cfg.model.seq_length
        if len(self.model) > 1 or batch.one_chunk_pipeline(self.cfg):
            # The interleaved schedule takes one iterator per model chunk; each chunk reads every micro-batch of
            # the step once, so `tee` hands them the same batches and `data_iterator` advances by one step.
            data_iterator = list(itertools.tee(data_iterator, len(self.model)))
        return self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=data_iterator,
            model=self.model,
            num_microbatches=self.num_microbatches,
            seq_length=seq,
            micro_batch_size=self.cfg.training.micro_batch_size,
            decoder_seq_length=seq,
            forward_only=forward_only,
        )

    def _aux_figures(self) -> dict[str, float]:
        """MoE figures of the step. Collective: every rank calls it, MoE layers or not."""
        moe = self.cfg.moe
        aux, z = self.logged_losses
        if self.own_moe:
            self._expert_counts = {}
            figures = collect_moe_metrics(
                self.model,
                num_layers=self.cfg.model.layer_count,
                num_experts=moe.num_experts,
                expert_counts=self._expert_counts,
            )
        else:
            tracked = pop_moe_aux_losses(self.cfg.model.layer_count, self.num_moe_layers, self.num_microbatches)
            balancing = tracked.get(BALANCING_NAMES.get(moe.moe_router_load_balancing_type, "load_balancing_loss"))
            figures = {"moe aux loss": balancing, "moe z loss": tracked.get("z_loss")} if tracked else {}
        return computed_losses_only(figures, aux=aux, z=z)

    def train_step(self) -> dict:
        """One optimizer step over the global batch; returns its figures."""
        if self._raise_at == self.state.iteration + 1:
            raise RuntimeError(f"injected failure at step {self._raise_at} (${RAISE_AT_ENV}, test only)")
        if self.watchdog:
            self.watchdog.set_step(self.state.iteration + 1)
        if self._nan_at == self.state.iteration + 1:
            embedding = unwrap_model(self.model[0]).embedding  # the first pipeline stage's (test only)
            embedding.register_forward_hook(_nan_output)
        started = time.perf_counter()
        if self.comm_timers:
            self.comm_timers.reset()
        elif self.arrivals:
            self.arrivals.reset()
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.forward_flags:
            self.forward_flags.reset()
        if self.own_moe:
            # The factor megatron-core's schedule gives the lm loss: router-loss grads become a
            # per-step mean whatever the number of micro-batches.
            scale = self._loss_scale() * parallel_state.get_context_parallel_world_size() / self.num_microbatches
            set_moe_aux_loss_scale(self.model, scale)
        self.overlap.start_iteration()  # counted from this job's start: a resumed job profiles its own cluster
        losses = self._run_microbatches(self.data.train_iterator, forward_only=False)
        self.overlap.end_iteration()
        if self.own_moe:  # where megatron-core's finalize_model_grads moves its expert biases, resets its tallies
            finish_router_step(self.model)
        with comm.host_read("optimizer step (found-inf, grad norm)"):  # megatron-core reads them inside
            update_successful, grad_norm, num_zeros = self.optimizer.step()
        # Megatron-LM's --log-params-norm: after the update, on every rank (a collective).
        with comm.host_read("params norm"):
            norm = params_norm(self.optimizer) if self.cfg.logging.log_params_norm else None
        gbs = self.cfg.training.global_batch_size
        if update_successful:
            self.scheduler.step(increment=gbs)
        self.state.iteration += 1
        self.state.consumed_train_samples += gbs
        lm_loss = _reduce_lm_loss(losses)
        if self.check_finite:
            check_loss(lm_loss, iteration=self.state.iteration, rank=self.rank, origin=self.forward_flags.describe)
        aux = self._aux_figures() | pop_mtp_losses(self.cfg.model.mtp_layers, self.num_microbatches)  # the MTP stage
        step_ms = 1000.0 * (time.perf_counter() - started)
        # Read after the step's loss and metrics reached the host: on a GPU nothing more is waited for. Every
        # rank with the timers on takes part: the arrival stamps go to the logging rank's groups (comm/skew.py).
        summary = None
        with comm.host_read("comm timers"):
            if self.comm_timers:
                summary = self.comm_timers.summary(reader=self.logging_rank)
            elif self.arrivals:
                self.arrivals.exchange(reader=self.logging_rank)
        return {
            "lm loss": lm_loss,
            "aux": aux,
            "grad_norm": grad_norm,
            "num_zeros": None if num_zeros is None else int(num_zeros),
            "params_norm": norm,
            "skipped": not update_successful,
            "step_ms": step_ms,
            "comm": summary,
            **self.overlap.stats(),  # "wgrad", "grad_reduce"
        }

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation token loss over `--eval-iters` global batches (same batches every time)."""
        if self.cfg.training.eval_iters == 0:
            return None
        iterator = self.data.valid_iterator()
        if iterator is None:
            return None
        for chunk in self.model:
            chunk.eval()
        totals = []
        for _ in range(self.cfg.training.eval_iters):
            losses = self._run_microbatches(iterator, forward_only=True)
            if parallel_state.is_pipeline_last_stage():
                totals += losses
        if not self.own_moe:  # our layers record nothing in evaluation
            pop_moe_aux_losses(self.cfg.model.layer_count, self.num_moe_layers, self.num_microbatches)
        clear_mtp_losses()
        for chunk in self.model:
            chunk.train()
        return _reduce_lm_loss(totals)

    @contextlib.contextmanager
    def _params_gathered(self):
        """Every parameter up to date: under --overlap-param-gather the step's all-gather finishes in the next
        forward's pre-hooks, so evaluation and checkpoints (which are no training forward) gather them first
        (Megatron-LM's disable/enable of the pre-hooks)."""
        lazy = [chunk for chunk in self.model if getattr(chunk, "use_forward_hook", False)]
        for chunk in lazy:
            chunk.disable_forward_pre_hook()  # gathers now
        try:
            yield
        finally:
            for chunk in lazy:
                chunk.enable_forward_pre_hook()

    def _validate_and_log(self) -> None:
        if self._validated_at == self.state.iteration:
            return
        self._validated_at = self.state.iteration
        with self._params_gathered():
            loss = self.evaluate()
        if self.logger and loss is not None:
            self.logger.validation(self.state.iteration, {"lm loss": loss})
            self._validation_losses[self.state.iteration] = loss

    def _save(self) -> None:
        if self.cfg.checkpoint.save:
            with self._params_gathered():
                args = (self.cfg.checkpoint.save, self.cfg, self.model, self.optimizer, self.scheduler, self.state)
                save_checkpoint(*args, data=self.data.record)

    def _log_step(self, iteration: int, figures: dict) -> dict:
        """Log one step's figures (logging rank); returns its history entry: what the log line shows."""
        aux, summary = figures["aux"], figures["comm"]
        shown = {"lm loss": figures["lm loss"], **{k: v for k, v in aux.items() if "/" not in k}}
        comm_figures = comm_layers = comm_kinds = None
        tensorboard_only = {k: v for k, v in aux.items() if "/" in k}
        if summary is not None:
            exposed, wire = summary.total_exposed_ms, summary.total_wire_ms
            comm_figures = (figures["step_ms"], exposed, wire, summary.total_skew_ms, summary.total_transfer_ms)
            comm_layers = layer_exposed_and_wire(summary)
            comm_kinds = exposed_by_group(summary.exposed_ms)
            tensorboard_only.update(tensorboard_scalars(summary))
        lr = self.optimizer.param_groups[0]["lr"]
        self.logger.step(
            iteration,
            shown,
            lr=lr,
            grad_norm=figures["grad_norm"],
            params_norm=figures["params_norm"],
            skipped=figures["skipped"],
            tensorboard_only=tensorboard_only,
            comm=comm_figures,
            comm_layers=comm_layers,
            comm_kinds=comm_kinds,
            num_zeros=figures["num_zeros"],
            consumed_samples=self.state.consumed_train_samples,
            loss_scale=self._loss_scale() if self.cfg.training.fp16 else None,
            expert_counts=self._expert_counts,
        )
        entry = {"iteration": iteration, **shown, "grad norm": figures["grad_norm"], "skipped": figures["skipped"]}
        entry["learning rate"] = lr  # after the scheduler counted this step's samples, as Megatron-LM logs it
        if figures["num_zeros"] is not None:
            entry["num zeros"] = figures["num_zeros"]
        # This (the logging) rank's own step time and communication.
        entry["step_ms"] = figures["step_ms"]
        entry["comm"] = summary.as_dict() if summary is not None else None
        entry["wgrad"] = figures["wgrad"]  # Lancet's queue on this rank: where its dW ran, held memory
        entry["grad_reduce"] = figures["grad_reduce"]  # the adaptive partition's bucket groups MoE layers released
        if figures["params_norm"] is not None:
            entry["params norm"] = figures["params_norm"]
        shadowed = moe_shadowed(self.model)
        if shadowed:
            entry["shadowed"] = shadowed
        if self._expert_counts:  # our layer: the step's routed pairs per expert of every MoE layer, whole model
            entry["tokens_per_expert"] = {number: list(counts) for number, counts in self._expert_counts.items()}
        if not self._degrees_logged:  # the first logged step: the pipeline degrees in force (auto resolved)
            self._degrees_logged = True
            entry["pipeline_degrees"] = moe_pipeline_degrees(self.model)
            entry["startup"] = self.startup
        return entry

    def _clock_offset(self) -> ClockOffset:
        """This rank's clock against rank 0's, for the skew (collective on the world; comm/skew.py)."""
        offset = estimate_clock_offset()
        if not offset.shared:
            log.info(
                "rank %d: host clock %+.3f ms from rank 0's (estimated at start-up, +-%.3f ms): skew figures carry "
                "that error",
                self.rank,
                1000.0 * offset.seconds,
                1000.0 * offset.error_s,
            )
        return offset

    def _loss_scale(self) -> float:
        with comm.host_read("loss scale"):
            return self.optimizer.get_loss_scale().item()

    def train(self) -> list[dict]:
        """Run to `--train-iters`; returns each step's logged figures (lm loss, MoE losses and figures,
        grad norm, params norm with --log-params-norm, skip flag, `step_ms`, and `comm`: the communication
        timers' summary as a dict, None with --no-comm-timers; with our MoE layer `tokens_per_expert`, {layer
        number: the step's routed pairs per expert, every rank's}; `validation lm loss` at the steps validated)
        on the logging rank, its own rank's figures (the only rank that times its collectives)."""
        monitor = self.comm_timers or self.arrivals
        timing = comm.monitoring(monitor) if monitor else contextlib.nullcontext()
        with timing:
            return self._train()

    def _train(self) -> list[dict]:
        t, ck = self.cfg.training, self.cfg.checkpoint
        history = []
        start_iteration = self.state.iteration
        started = time.perf_counter()
        exit_request = ExitRequest(exit_duration_in_mins=ck.exit_duration_in_mins, signals=self.signals)
        preempted = False
        saved_at = None  # the iteration the last interval save wrote
        while self.state.iteration < t.train_iters:
            figures = self.train_step()
            self.overlap.started()
            it = self.state.iteration
            if self.logger:
                history.append(self._log_step(it, figures))
                if self.hidden_check and figures["comm"] is not None:
                    self.hidden_check.observe(figures["comm"])
                if self.overlap_report and figures["comm"] is not None:
                    if (report := self.overlap_report.observe(it, figures["comm"], figures["step_ms"])) is not None:
                        history[-1]["overlap_report"] = report
                        log.info("%s", overlap_report_text(report))
                if self.overlap.wgrad_report_due():
                    log.info(
                        "--overlap-wgrad-report:\n%s", wgrad_report(self.overlap.wgrad_queue.schedule, figures["comm"])
                    )
                spike = self.spikes.observe(it, figures["lm loss"])
                if spike:
                    log.warning(spike)
            if t.eval_interval and it % t.eval_interval == 0 and it < t.train_iters:
                self._validate_and_log()
            if ck.save_interval and it % ck.save_interval == 0 and it < t.train_iters:
                self._save()
                saved_at = it
            if ck.exit_interval and it - start_iteration >= ck.exit_interval:
                log.info("--exit-interval=%d reached at iteration %d", ck.exit_interval, it)
                break
            if exit_request.requested():
                if saved_at == it:  # the request came during that save (it completed): nothing more to write
                    log.info("%s: iteration %d is saved; exiting", exit_request.reason, it, extra=ONCE)
                else:
                    log.info("%s: saving at iteration %d and exiting", exit_request.reason, it, extra=ONCE)
                preempted = True
                break
        self.overlap.started()
        if not preempted:  # time is short when preempted: save only
            self._validate_and_log()
        if saved_at != self.state.iteration:
            self._save()
        for entry in history:  # the validations of the steps the history holds (the last one's included)
            if entry["iteration"] in self._validation_losses:
                entry["validation lm loss"] = self._validation_losses[entry["iteration"]]
        if self.logger:
            log.info(
                "trained %d iterations in %.1f s", self.state.iteration - start_iteration, time.perf_counter() - started
            )
            self.logger.close()
        return history


def moe_pipeline_degrees(model) -> dict[str, list[int]]:
    """Our MoE layers' pipeline degrees in force: layer number -> [forward, backward] (FSMoE pipeline;
    "auto" is resolved at set-up). Empty without our MoE layers."""
    return {str(layer.layer_number): list(layer.pipeline_degrees()) for layer in moe_layer_modules(model)}


def moe_shadowed(model) -> dict[str, list[int]]:
    """The experts each of our MoE layers shadowed in its last forward (FasterMoE, moe/shadow.py; the same on every
    rank of its EP group): layer number -> experts. Empty where no layer may shadow."""
    return {
        str(layer.layer_number): list(layer.last_shadowed) for layer in moe_layer_modules(model) if layer.shadow.active
    }
