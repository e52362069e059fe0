"""TensorBoard for a person: which tags a run writes, in which group, and never a line that stays at zero.

In: every scalar the training logger hands over (`Dashboard.scalars`); out: the tags written. Rules:
1. a tag only where its quantity can be non-zero in the run's layout (`TagLayout.can_occur`);
2. one group per concern (`tag_of`: loss/, optim/, throughput/, memory/, moe/, comm/ and detail groups), with
   Megatron-LM's name as the leaf, plus its samples axis under vs_samples/ for loss and optimizer;
3. a tag zero at every step so far is held back (`ZeroHold`), its zeros written at their steps once it turns
   non-zero. The rules in full: docs/internals/config.md; the tags: docs/tensorboard.md.
"""

from __future__ import annotations

import dataclasses
import re
import time

from megatron_moe.comm.skew import SKEW_KINDS
from megatron_moe.comm.timers import SUMMARY_KINDS
from megatron_moe.config.parallel_dims import ParallelDims

TAGS = {
    "lm loss": "loss/lm loss",
    "lm loss validation": "loss/lm loss validation",
    "lm loss validation ppl": "loss/lm loss validation ppl",
    "learning-rate": "optim/learning-rate",
    "grad-norm": "optim/grad-norm",
    "params-norm": "optim/params-norm",
    "num-zeros": "optim/num-zeros",
    "loss-scale": "optim/loss-scale",
    "batch-size": "optim/batch-size",
    "iteration-time": "throughput/iteration-time",
    "tokens-per-sec": "throughput/tokens-per-sec",
    "throughput": "throughput/tflops-per-device",
    "mem-bytes": "memory/mem-bytes",
}
"""The training logger's names (Megatron-LM's tags where the quantity is the same) -> their tags here. The MoE
figures (`moe aux loss` -> `moe/aux loss`, `moe/layer_NNN/...` -> `moe_layers/layer_NNN/...`) and the
communication timers' tags (training/comm_report.py `tensorboard_scalars`, already grouped) follow patterns."""
GROUPS = ("loss", "optim", "throughput", "memory", "moe", "comm", "moe_layers", "comm_detail", "comm_layers")
"""The groups, the dashboard's order: the concerns first, then the per-layer and per-kind detail."""
SAMPLES_GROUPS = ("loss", "optim")
"""Groups whose tags are also written against the consumed samples, under `vs_samples/`."""
SAMPLES_PREFIX = "vs_samples/"


def tag_of(name: str) -> str:
    """The tag of a logger name (`TAGS`, `moe <figure>` -> `moe/<figure>`, `moe/layer_NNN/` -> `moe_layers/`);
    a name already in a group stays; any other goes to `other/` rather than be lost."""
    if name in TAGS:
        return TAGS[name]
    if re.fullmatch(r"mtp_\d+ loss", name):  # multi-token prediction's per-layer losses, Megatron-LM's names
        return "loss/" + name
    if name.startswith("moe/layer_"):
        return "moe_layers/" + name.removeprefix("moe/")
    if name.startswith("moe "):
        return "moe/" + name.removeprefix("moe ")
    if name.endswith((" validation", " validation ppl")):
        return "loss/" + name
    if name.split("/", 1)[0] in GROUPS:
        return name
    return "other/" + name


def expert_load_tag(layer: int, expert: int) -> str:
    """An MoE layer's tokens per expert, one scalar per expert (tools/plot_run.py's heat map reads them)."""
    return f"moe_layers/layer_{layer:03d}/expert_{expert:03d}_tokens"


def expert_load_histogram_tag(layer: int) -> str:
    return f"moe_layers/layer_{layer:03d}/tokens_per_expert"


_EXPERT_LOAD = re.compile(r"^(moe_layers/layer_\d+)/expert_\d+_tokens$")


def hold_family(tag: str) -> str:
    """What `ZeroHold` releases together: a layer's expert loads as one, every other tag alone."""
    expert = _EXPERT_LOAD.match(tag.removeprefix(SAMPLES_PREFIX))
    return f"{expert.group(1)}/expert_tokens" if expert else tag


@dataclasses.dataclass(frozen=True, kw_only=True)
class TagLayout:
    """What can be non-zero in a run: its parallel degrees and the features that make a quantity exist."""

    dims: ParallelDims
    moe: bool = False
    drops: bool = False
    """Tokens can be dropped (a positive --moe-expert-capacity-factor that drops: config's `DROPPING`)."""
    shadow: bool = False
    """--moe-shadow-experts other than off."""
    fp16: bool = False

    @classmethod
    def of(cls, cfg, world_size: int) -> TagLayout:
        from megatron_moe.config.conditions import DROPPING

        moe = cfg.moe
        return cls(
            dims=cfg.dims(world_size),
            moe=moe.is_moe,
            drops=moe.is_moe and DROPPING.test(cfg),
            shadow=moe.is_moe and moe.moe_shadow_experts != "off",
            fp16=cfg.training.fp16,
        )

    def comm_kinds(self) -> frozenset[str]:
        """The timers' kinds (comm/timers.py `SUMMARY_KINDS`) that can carry traffic in this layout: a collective
        on a group of one rank moves nothing."""
        d, moe = self.dims, self.moe
        kinds = set()
        if moe and d.ep > 1:
            kinds |= {"a2a_dispatch", "a2a_dispatch_bwd", "a2a_combine", "a2a_combine_bwd"}
            if self.shadow:
                kinds |= {"shadow", "shadow_bwd"}
        if moe and d.esp > 1:
            kinds |= {"esp_ag", "esp_ag_bwd", "esp_rs", "esp_rs_bwd"}
        if d.dp * d.cp > 1 or (moe and d.expert_dp > 1):  # the dense gradients over DP x CP, the experts' over EDP
            kinds.add("dp_grad_reduce")
        if d.tp > 1 or (moe and d.esp > 1):  # megatron-core's collectives on the TP and expert-TP groups
            kinds.add("tp")
        if d.pp > 1:
            kinds.add("pp_p2p")
        if d.world > 1:  # the loss and metrics reductions, the clock offset, planning
            kinds.add("other")
        return frozenset(kinds)

    def can_occur(self, tag: str) -> bool:
        """Whether `tag` (a tag here, `tag_of`'s) can be non-zero in this layout."""
        tag = tag.removeprefix(SAMPLES_PREFIX)
        group, _, rest = tag.partition("/")
        if group in ("comm", "comm_detail", "comm_layers"):
            return self._comm_can_occur(rest)
        if group in ("moe", "moe_layers"):
            return self.moe and (self.drops or "dropped" not in rest)
        if tag == "optim/loss-scale":
            return self.fp16
        return True

    def _comm_can_occur(self, rest: str) -> bool:
        kinds = self.comm_kinds()
        parts = rest.split("/")
        kind = parts[-1]
        if kind not in SUMMARY_KINDS:  # a total: of any kind (skew: of the kinds whose skew is measured)
            skewed = any(k.removesuffix("_bwd") in SKEW_KINDS for k in kinds)
            return bool(kinds) and ("skew" not in rest or skewed)
        skew_measured = kind.removesuffix("_bwd") in SKEW_KINDS
        return kind in kinds and ("skew_ms" not in parts or skew_measured)


class ZeroHold:
    """Holds back each tag family's points while every one so far was zero (module docstring, rule 3).

    At most `limit` held points per family are kept (the latest): a tag zero for a very long run before it
    turns non-zero loses its oldest zeros, not memory."""

    def __init__(self, limit: int = 1000):
        self.limit = limit
        self._held: dict[str, list[tuple[str, float, int, float]]] = {}
        self._live: set[str] = set()

    def admit(self, tag: str, value: float, step: int) -> list[tuple[str, float, int, float]]:
        """The (tag, value, step, wall time) points to write now: none while the family is all zeros."""
        family = hold_family(tag)
        point = (tag, value, step, time.time())
        if family in self._live:
            return [point]
        held = self._held.setdefault(family, [])
        if value == 0:
            held.append(point)
            if len(held) > self.limit:
                del held[0]
            return []
        self._live.add(family)
        return [*self._held.pop(family), point]

    def held_tags(self) -> set[str]:
        """Tags not written (yet): zero at every step so far."""
        return {tag for points in self._held.values() for tag, *_ in points}


class Dashboard:
    """The logger's TensorBoard writer (and wandb's scalars): names -> tags, the layout's filter, the zero hold,
    the samples axis."""

    def __init__(self, writer, *, layout: TagLayout | None = None, wandb_run=None):
        """`writer`: a SummaryWriter (None: no TensorBoard); `layout` None: every tag can occur."""
        self.writer, self.layout, self.wandb_run = writer, layout, wandb_run
        self.hold = ZeroHold()

    def _can_occur(self, tag: str) -> bool:
        return self.layout is None or self.layout.can_occur(tag)

    def scalars(self, values: dict[str, float], step: int, samples: int | None = None) -> None:
        """Logger names -> their tags at `step`; the loss and optimizer tags also at `samples` (consumed)."""
        tagged = {tag_of(name): float(value) for name, value in values.items()}
        tagged = {tag: value for tag, value in tagged.items() if self._can_occur(tag)}
        if self.writer:
            for tag, value in tagged.items():
                self._write(tag, value, step)
                if samples is not None and tag.split("/", 1)[0] in SAMPLES_GROUPS:
                    self._write(SAMPLES_PREFIX + tag, value, samples)
        if self.wandb_run is not None:
            self.wandb_run.log(tagged, step=step)

    def expert_loads(self, expert_counts: dict[int, list[float]], step: int, *, scalar_layers: int) -> None:
        """Tokens per expert of each MoE layer: a histogram per layer, and a scalar per expert for the first
        `scalar_layers` MoE layers."""
        if not self.writer or not expert_counts or not self._can_occur("moe_layers/"):
            return
        import torch

        for number, counts in sorted(expert_counts.items()):
            self.writer.add_histogram(expert_load_histogram_tag(number), torch.tensor(counts), step)
        for number in sorted(expert_counts)[:scalar_layers]:
            for expert, count in enumerate(expert_counts[number]):
                self._write(expert_load_tag(number, expert), float(count), step)

    def _write(self, tag: str, value: float, step: int) -> None:
        for point_tag, point_value, point_step, wall in self.hold.admit(tag, value, step):
            self.writer.add_scalar(point_tag, point_value, point_step, walltime=wall)

    def flush(self) -> None:
        if self.writer:
            self.writer.flush()

    def close(self) -> None:
        if self.writer:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
