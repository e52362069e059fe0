"""The MoE layer: route -> order -> dispatch -> experts -> combine -> unorder, with hooks between.

Legend: S = sequence (this TP rank's shard under sequence parallelism),
B = micro-batch, T = S x B tokens, H = hidden, R = expert-major rows.

It fills the MLP slot of a megatron-core TransformerLayer: built by
`build_module(spec, config=config)`, called as `layer(hidden_SBH,
padding_mask=...)`, returns `(output_SBH, None)`. Every stage is a pluggable
object (Gate, Ordering, Dispatcher, Experts) chosen by `MoELayerConfig`, so a
user swaps one without touching the others or this file. Process groups come
from the constructor, else from megatron-core's `parallel_state`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_moe import comm
from megatron_moe.config import features
from megatron_moe.config.fields import require
from megatron_moe.config.moe_layer import AUTO, MoELayerConfig
from megatron_moe.moe import handover
from megatron_moe.moe.aux_loss import AuxLossAutoScaler
from megatron_moe.moe.capacity import expert_capacity
from megatron_moe.moe.dispatch import DispatchSplits, build_dispatcher
from megatron_moe.moe.experts import Experts, FFNExperts
from megatron_moe.moe.gates import build_gate
from megatron_moe.moe.hooks import HookContext, HookHandle, MoEHook
from megatron_moe.moe.metrics import MoEStats
from megatron_moe.moe.ordering import DenseOrdering, RowMap, build_ordering, expert_counts, make_row_map
from megatron_moe.moe.pieces import Piece, batch_order
from megatron_moe.moe.pipeline import PipelineStart, start_pipeline
from megatron_moe.moe.routing import Routing, entropy_sum
from megatron_moe.moe.shadow import AUTO as SHADOW_AUTO
from megatron_moe.moe.shadow import ShadowCosts, ShadowPolicy, arrange_shadowed
from megatron_moe.moe.shared import SharedExpert
from megatron_moe.platform import to_host
from megatron_moe.platform.rng import expert_parallel_stream, host_rng_keyed, rng_tracker

log = logging.getLogger("megatron_moe")


def _default_groups():
    """(EP group, expert-DP group, ESP group) from megatron-core, or (None, None, None) in a single process.

    The ESP group is megatron-core's expert tensor parallel group (`--expert-tensor-parallel-size`)."""
    if not parallel_state.model_parallel_is_initialized():
        return None, None, None
    return (
        parallel_state.get_expert_model_parallel_group(),
        parallel_state.get_expert_data_parallel_group(),
        parallel_state.get_expert_tensor_parallel_group(),
    )


class MoELayer(MegatronModule):
    """A mixture-of-experts MLP whose stages are named methods and pluggable objects."""

    def __init__(
        self,
        config: TransformerConfig,
        moe_config: MoELayerConfig,
        *,
        ep_group=None,
        expert_dp_group=None,
        esp_group=None,
        experts: ModuleSpec | Callable | None = None,
        hooks: Sequence[MoEHook] = (),
        layer_number: int | None = None,
    ):
        super().__init__(config=config)
        if ep_group is None and expert_dp_group is None and esp_group is None:
            ep_group, expert_dp_group, esp_group = _default_groups()
        esp_size = comm.group_size(esp_group)
        self.cfg = moe_config.validate(ep_size=comm.group_size(ep_group), esp_size=esp_size)
        if experts is not None and esp_size > 1:
            raise TypeError(
                f"custom experts cannot be sharded: --expert-tensor-parallel-size={esp_size} needs the built-in "
                "experts (FFNExperts); use --expert-tensor-parallel-size 1"
            )
        self.dispatcher = build_dispatcher(
            self.cfg.dispatcher,
            ep_group,
            self.cfg.num_experts,
            layer=layer_number,
            esp_group=esp_group,
            a2a=self.cfg.a2a_algorithm,
        )
        self.layer_number = layer_number
        self.num_local_experts = self.dispatcher.num_local_experts
        self.gate = build_gate(self.cfg)
        self._key_forced_bias()
        self.ordering = build_ordering(self.cfg.ordering)
        self.experts = self._build_experts(config, experts, ep_group, expert_dp_group, esp_group)
        self.shared_expert = None
        if self.cfg.shared_expert_ffn_hidden_size:
            self.shared_expert = SharedExpert(
                hidden_size=self.cfg.hidden_size,
                ffn_hidden_size=self.cfg.shared_expert_ffn_hidden_size,
                gated=self.cfg.gated,
                init_method=config.init_method,
                output_init_method=config.output_layer_init_method,
                sequence_parallel=config.sequence_parallel,
                params_dtype=config.params_dtype,
                gate=self.cfg.shared_expert_gate,
            )
        # Under sequence parallelism each TP rank routes its own tokens: router grads are partial,
        # and the router losses are over the whole sequences' tokens (all TP ranks).
        for param in self.gate.parameters():
            param.sequence_parallel = config.sequence_parallel
        if config.sequence_parallel and parallel_state.model_parallel_is_initialized():
            self.gate.token_group = parallel_state.get_tensor_model_parallel_group()
        if parallel_state.model_parallel_is_initialized():  # global_aux_loss counts over every rank of the stage
            self.gate.global_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        self.gate.to(config.params_dtype)
        self.hooks: list[MoEHook] = list(hooks)
        self.stats = MoEStats(self.cfg.num_experts)
        self.aux_loss_scale = 1.0
        """Gradient scale of the router losses; the loop sets loss_scale / micro-batches."""
        self._scope = None
        self._pipeline_degrees: tuple[int, int] | None = None
        """Set by `set_pipeline_degrees` (the resolved "auto"); None: the config's ints, "auto" as 1."""
        self._pipeline_notes: set[str] = set()
        """Why "auto" runs r = 1 here, each said once in the log."""
        self.shadow = ShadowPolicy(self.cfg.shadow_experts, self.num_local_experts)
        """FasterMoE's shadow experts (`megatron_moe.moe.shadow`): which experts each forward replicates."""
        self.last_shadowed: tuple[int, ...] = ()
        """The experts the last forward shadowed (the same on every rank of the EP group)."""
        blocker = self._shadow_config_blocker()
        if blocker is None and type(self.experts) is not FFNExperts:
            blocker = self._shadow_blocker()
        if self.shadow.active and blocker is not None:
            require(self.shadow.mode == SHADOW_AUTO, "--moe-shadow-experts", self.cfg.shadow_experts, f"off: {blocker}")
            self._note(f"shadow experts auto is off: {blocker}")
            self.shadow = ShadowPolicy("off", self.num_local_experts)

    def use_activation_scope(self, scope) -> None:
        """Run the stages as named regions of an activation policy (`megatron_moe.activations`):
        router, ordering, dispatch, expert_fc1/act/fc2 (built-in experts), combine, unorder, shared_expert."""
        self._scope = scope
        if hasattr(self.experts, "use_activation_scope"):
            self.experts.use_activation_scope(scope)

    def _region(self, name: str, fn, *args):
        return fn(*args) if self._scope is None else self._scope.call(name, fn, *args)

    def _in_region(self, name: str):
        return contextlib.nullcontext() if self._scope is None else self._scope.region(name)

    def _build_experts(self, config, experts, ep_group, expert_dp_group, esp_group) -> torch.nn.Module:
        key = (self.cfg.init_seed, self.layer_number or 0)
        if experts is None:  # each global expert's weights from `key` and its index alone (FFNExperts._initialize)
            return FFNExperts(
                num_local_experts=self.num_local_experts,
                hidden_size=self.cfg.hidden_size,
                ffn_hidden_size=self.cfg.ffn_hidden_size,
                gated=self.cfg.gated,
                init_method=config.init_method,
                output_init_method=config.output_layer_init_method,
                ep_group=ep_group,
                expert_dp_group=expert_dp_group,
                esp_group=esp_group,
                params_dtype=config.params_dtype,
                init_seed=self.cfg.init_seed,
                layer_number=self.layer_number or 0,
            )
        kwargs = dict(
            num_local_experts=self.num_local_experts,
            moe_config=self.cfg,
            ep_group=ep_group,
            expert_dp_group=expert_dp_group,
        )
        # Custom experts differ per EP rank on any device: host draws keyed by the rank's first global expert,
        # device draws from megatron's expert-parallel stream.
        tracker, name = rng_tracker(), expert_parallel_stream()
        forked = tracker.is_initialized() and name in tracker.get_states()
        first_expert = comm.group_rank(ep_group) * self.num_local_experts
        with host_rng_keyed(*key, first_expert), tracker.fork(name) if forked else contextlib.nullcontext():
            module = build_module(experts, **kwargs) if isinstance(experts, ModuleSpec) else experts(**kwargs)
        if not isinstance(module, Experts) or module.num_local_experts != self.num_local_experts:
            raise TypeError(
                f"custom experts {type(module).__name__} must be an nn.Module with "
                f"num_local_experts={self.num_local_experts} and forward(rows, counts)"
            )
        return module

    def set_pipeline_degrees(self, forward: int, backward: int) -> None:
        """The pipeline's chunks forward and backward from now on (the training set-up resolves "auto" so)."""
        for flag, value in (("--moe-pipeline-degree", forward), ("--moe-bp-pipeline-degree", backward)):
            require(type(value) is int and value >= 1, flag, value, "an integer >= 1 (1: not pipelined)")
        self._pipeline_degrees = (forward, backward)

    def pipeline_degrees(self) -> tuple[int, int]:
        """(forward, backward) chunks of the dispatch -> experts -> combine pipeline in this forward; (1, 1):
        the stages run apart. An explicit degree > 1 that cannot run is an error naming its flag; "auto" is 1
        there (said once in the log), and 1 until the training set-up resolves it."""
        configured = (self.cfg.pipeline_degree, self.cfg.bp_pipeline_degree)
        if self._pipeline_degrees is not None:
            degrees = self._pipeline_degrees
        else:
            degrees = tuple(1 if d == AUTO else d for d in configured)
            if AUTO in configured:
                self._note("the pipeline degree auto is not resolved (no cost-model plan): r = 1")
        blocker = None if degrees == (1, 1) else self._pipeline_blocker()
        if blocker is None:
            return degrees
        for flag, value in (("--moe-pipeline-degree", configured[0]), ("--moe-bp-pipeline-degree", configured[1])):
            require(value == AUTO or value == 1, flag, value, f"1 or auto: {blocker}")
        self._note(f"the pipeline degree auto runs r = 1: {blocker}")
        return 1, 1

    def _pipeline_blocker(self) -> str | None:
        """Why the pipeline cannot run this layer now (its experts, activation policy or hooks), or None."""
        if type(self.experts) is not FFNExperts:
            return f"custom experts ({type(self.experts).__name__}) do not run in the pipeline's chunks"
        if self.experts.keeping is None:
            return "the activation policy runs expert_fc1/act/fc2 as separate regions (expert_fc2 recomputed)"
        return self._hooks_blocker()

    def _shadow_blocker(self) -> str | None:
        """Why this layer cannot shadow experts now (its experts, activation policy or hooks), or None."""
        if type(self.experts) is not FFNExperts:
            return f"custom experts ({type(self.experts).__name__}) have no weight1 / weight2 to broadcast"
        if self.experts.keeping is None:
            return "the activation policy runs expert_fc1/act/fc2 as separate regions"
        return self._hooks_blocker()

    def _shadow_config_blocker(self) -> str | None:
        """The flags' and layout's reason against shadowing (`config.features.shadow_blocker`), or None."""
        d = self.dispatcher
        blocked = features.shadow_blocker(self.cfg, ep_size=d.group_size, esp_size=d.esp_size)
        return None if blocked is None else blocked.why

    def _hooks_blocker(self) -> str | None:
        for hook in self.hooks:
            for point in ("after_dispatch", "before_combine"):
                if getattr(type(hook), point) is not getattr(MoEHook, point):
                    return f"the hook {type(hook).__name__}.{point} needs the whole dispatched rows"
        return None

    def set_shadow_costs(self, costs: ShadowCosts) -> None:
        """The cluster's fitted lines and this layer's sizes, for --moe-shadow-experts auto (the training set-up
        gives them where it has a cost-model profile; auto shadows nothing until then)."""
        self.shadow.costs = costs

    def _shadows(self, routing: Routing) -> bool:
        """Whether this forward gathers the [G, E] counts and may shadow experts."""
        if not self.shadow.active or routing.is_soft or routing.slots_per_expert is not None:
            return False
        blocker = self._shadow_blocker()
        if blocker is not None:
            require(self.shadow.mode == SHADOW_AUTO, "--moe-shadow-experts", self.cfg.shadow_experts, f"off: {blocker}")
            self._note(f"shadow experts auto shadows nothing: {blocker}")
            return False
        return True

    def _note(self, text: str) -> None:
        if text not in self._pipeline_notes:
            self._pipeline_notes.add(text)
            log.info("MoE layer %s: %s", self.layer_number, text)

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = self.dispatcher.layer = layer_number
        self._key_forced_bias()

    def _key_forced_bias(self) -> None:
        """--moe-router-force-biased with a negative STD: the layer's one bias is keyed by (--seed, layer)."""
        if getattr(self.gate, "forced_bias", None) is not None:
            self.gate.forced_bias.key = (self.cfg.init_seed, self.layer_number or 0)

    def register_moe_hook(self, hook: MoEHook) -> HookHandle:
        self.hooks.append(hook)
        return HookHandle(self.hooks, hook)

    # ------------------------------------------------------------------ stages

    def route(self, x_TH: torch.Tensor, valid_T: torch.Tensor | None = None) -> Routing:
        return self.gate(x_TH, valid_T)

    def arrange(self, routing: Routing) -> tuple[RowMap, DispatchSplits]:
        """Capacity, the counts exchange, every pair's row in the expert-major buffer, and the dispatch's splits.

        The host waits for the device once here, and nowhere else in forward or backward:
        1. on the device: pairs per expert and this rank's capacity, agreed over the EP group when the
           layout needs one C (padded all-to-all);
        2. on the device: the dispatcher's counts exchange (alltoallv: rows each rank sends each local expert);
        3. ONE device->host copy of all of it; the host then lays out the rows and the split sizes. It is a
           `comm.host_read`: on NCCL, where 2. does not block the host, a peer that never joins 2. shows here,
           and the watchdog names this read and the exchange.
        """
        num_experts = routing.num_experts
        if self._shadows(routing):
            row_map, splits = arrange_shadowed(routing, self.shadow, self.dispatcher, self.experts, self.layer_number)
            self.last_shadowed = splits.shadow.shadowed
            return row_map, splits
        if routing.is_soft:  # every expert gets exactly its slots: nothing to count, cap or drop
            row_map = make_row_map(routing, capacity=None, padded=True)
            received_dev = self.dispatcher.exchange_counts(row_map.routed_E.new_full((num_experts,), row_map.capacity))
            with comm.host_read("moe plan counts", layer=self.layer_number):
                (received,) = to_host(received_dev)
            return row_map, self.dispatcher.make_splits(row_map.counts, received_dev, received)
        padded = self.dispatcher.needs_padding or isinstance(self.ordering, DenseOrdering)
        routed_E = expert_counts(routing.expert_N, num_experts)
        capacity_1 = self._capacity(routing, routed_E, padded)  # 1.
        if capacity_1 is None:
            sent_E = routed_E
        else:
            sent_E = capacity_1.expand(num_experts) if padded else torch.minimum(routed_E, capacity_1)
        received_dev = self.dispatcher.exchange_counts(sent_E)  # 2.
        with comm.host_read("moe plan counts", layer=self.layer_number):
            routed, capacity, received = to_host(routed_E, capacity_1, received_dev)  # 3.
        capacity = None if capacity is None else capacity[0]
        row_map = make_row_map(routing, capacity=capacity, padded=padded, routed_E=routed_E, routed=routed)
        return row_map, self.dispatcher.make_splits(row_map.counts, received_dev, received)

    def _capacity(self, routing: Routing, routed_E: torch.Tensor, padded: bool) -> torch.Tensor | None:
        """Slots per expert as a long [1] on the device; None: exact rows and nothing limits them (dropless)."""
        largest_1 = routed_E.max().view(1)
        if routing.slots_per_expert is not None:  # expert choice: loads fixed by the gate
            capacity = routing.slots_per_expert
        else:
            topk = routing.expert_N.numel() // max(routing.num_tokens, 1)
            capacity = expert_capacity(
                self.cfg.capacity_factor,
                num_tokens=routing.num_tokens,
                topk=topk,
                num_experts=routing.num_experts,
                largest_count=largest_1,
            )
        if isinstance(capacity, int):
            capacity = routed_E.new_full((1,), capacity)
        if not padded:
            return capacity
        return self.dispatcher.agree_capacity(largest_1 if capacity is None else capacity)

    def order(self, x_TH: torch.Tensor, row_map: RowMap) -> torch.Tensor:
        return self.ordering.encode(x_TH, row_map)

    def start_pipeline(self, rows_RH: torch.Tensor, row_map: RowMap, splits: DispatchSplits, degrees) -> PipelineStart:
        """dispatch -> experts -> combine in chunks (`megatron_moe.moe.pipeline`): chunk 0's all-to-all starts
        here, `finish()` runs the rest."""
        d = self.dispatcher
        links = d.chunk_transport()
        received_XL = splits.received_GL  # X = (ESP peer p, source g): every peer's under ESP
        if splits.esp_received_PGL is not None:
            received_XL = [row for peer_GL in splits.esp_received_PGL for row in peer_GL]
        counts = splits.shadow.sent_counts(row_map.counts)
        store = splits.shadow.owner_store(self.experts.weight_grad_store)
        return start_pipeline(
            rows_RH,
            self.experts,
            counts,
            received_XL,
            degrees,
            links,
            esp_rank=d.esp_rank,
            sent_GE=splits.sent_GE,
            store=store,
        )

    def unorder(self, rows_RH: torch.Tensor, row_map: RowMap) -> torch.Tensor:
        return self.ordering.decode(rows_RH, row_map)

    # ------------------------------------------------------------------ forward

    def forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """hidden [S, B, H] -> ([S, B, H], None). `padding_mask` [B, S], True = padding (kept out of stats)."""
        stages = self.stages(hidden_states, padding_mask)
        while True:  # through the yields (the operator partition interleaves them: moe/pieces.py)
            try:
                next(stages)
            except StopIteration as done:
                return done.value
            handover.at_yield()  # --overlap-moe-expert-parallel-comm: another micro-batch's backward runs on here

    def stages(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None, piece: Piece | None = None):
        """The forward as a generator that yields while an all-to-all is in flight, and returns what `forward`
        does. Lancet's operator partition (`megatron_moe.model.partition`) runs the other pieces' work at the yields;
        `forward` runs straight through them.
        1. route, arrange, order; the dispatch starts (pipelined: its chunk 0) -> yield;
        2. the shared expert; the experts; the combine starts (pipelined: every chunk but waited) -> yield;
        3. the combined rows unordered, the shared expert's output added, the router losses attached.
        `piece`: this call is one piece of a partitioned micro-batch; the router losses and statistics are the whole
        micro-batch's, made in the last piece's step 3."""
        shape = hidden_states.shape
        ctx = HookContext(self.layer_number)
        x_TH = self._hook("before_moe_start", hidden_states.reshape(-1, shape[-1]), ctx)
        valid_T = None if padding_mask is None else ~padding_mask.transpose(0, 1).reshape(-1).bool()
        if piece is None and hidden_states.dim() == 3:
            self.gate.seq_batch = shape[1]  # seq_aux_loss: the sequences the tokens flatten
        with self.gate.losses_later(piece is not None):
            routing = self._region("router", self.route, x_TH, valid_T)
        with self._in_region("ordering"):
            row_map, splits = self.arrange(routing)
        rows_RH = self._region("ordering", self.order, x_TH, row_map)
        ctx.counts = row_map.counts
        rows_RH = self._hook("before_dispatch", rows_RH, ctx)
        shadow = splits.shadow  # NO_SHADOWING, or the shadowed experts' rows stay here (moe/shadow.py)
        rows_RH = shadow.split(rows_RH)
        degrees = handover.chunked(self.pipeline_degrees())  # batch-level overlap: a paired pass unchunked
        if degrees == (1, 1):
            with self._in_region("dispatch"):  # dispatch: the dispatcher's, straight (one frame less on the path)
                handle = self.dispatcher.dispatch(rows_RH, splits)
            shadow.start()
            yield
            shared_TH = self._shared(x_TH)  # independent of the routed path: runs while the all-to-all is in flight
            with self._in_region("dispatch"):
                dispatched = handle.wait()
            ctx.counts = dispatched.counts
            rows_RH = self._hook("after_dispatch", dispatched.rows_RH, ctx)
            rows_RH = self.experts(rows_RH, dispatched.counts, **shadow.experts_options())  # experts
            rows_RH = self._hook("before_combine", rows_RH, ctx)
            with self._in_region("combine"):  # combine: `wait()` gives the rows in the pre-dispatch layout
                handle = self.dispatcher.combine(rows_RH, dispatched)
            shadow.compute()  # under the combine's all-to-all
            yield
            with self._in_region("combine"):
                rows_RH = handle.wait()
        else:
            pipeline = self.start_pipeline(rows_RH, row_map, splits, degrees)
            shadow.start()
            yield
            shared_TH = self._shared(x_TH)  # runs while chunk 0's all-to-all is in flight (and the last dX's)
            rows_RH = pipeline.finish()
            shadow.compute()
        rows_RH = shadow.merge(rows_RH)
        ctx.counts = row_map.counts
        rows_RH = self._hook("after_combine", rows_RH, ctx)
        out_TH = self._region("unorder", self.unorder, rows_RH, row_map)
        if shared_TH is not None:
            out_TH = out_TH + shared_TH
        out_TH = self._hook("before_moe_end", out_TH, ctx)
        if self.training and torch.is_grad_enabled():  # the expert bias's load: each piece adds its own pairs
            self.gate.record_load(routing, valid_T)
        if piece is None:
            out_TH = self._attach_router_losses(out_TH, routing, row_map, valid_T)
        else:
            out_TH = self._attach_batch_router_losses(out_TH, piece, routing, row_map, valid_T, shape)
        return out_TH.view(shape), None

    def _hook(self, point: str, tensor: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        """`tensor` through every registered hook's `point` (moe/hooks.py)."""
        for hook in self.hooks:
            tensor = getattr(hook, point)(tensor, ctx)
        return tensor

    def _shared(self, x_TH: torch.Tensor) -> torch.Tensor | None:
        return None if self.shared_expert is None else self._region("shared_expert", self.shared_expert, x_TH)

    def _attach_router_losses(self, out_TH, routing: Routing, row_map: RowMap, valid_T) -> torch.Tensor:
        """Feed the weighted router losses to backward and record the step's statistics.

        Only in a training forward with grad: an evaluation pass must not count,
        and under full activation recompute the first (no-grad) pass of a layer
        must not count twice.
        """
        if not (self.training and torch.is_grad_enabled()):
            return out_TH
        if routing.aux_loss is not None and routing.aux_loss.requires_grad:
            out_TH = AuxLossAutoScaler.apply(out_TH, routing.aux_loss, self.aux_loss_scale)
        tokens = routing.num_tokens if valid_T is None else valid_T.sum()  # a device count: no host read
        self.stats.record(
            routed_E=row_map.routed_E,
            dropped=row_map.dropped,
            tokens=tokens,
            entropy_sum=entropy_sum(routing.probs_TE, valid_T),
            losses=routing.losses,
        )
        return out_TH

    def _attach_batch_router_losses(self, out_TH, piece: Piece, routing: Routing, row_map: RowMap, valid_T, shape):
        """`_attach_router_losses` for one piece of a partitioned micro-batch: each piece leaves its routing here;
        the last one's output carries the router losses of the whole micro-batch (its tokens in their unpartitioned
        order: the same losses, and statistics recorded once)."""
        if not (self.training and torch.is_grad_enabled()):
            return out_TH
        pieces = piece.routings.setdefault(self, [])
        pieces.append((routing, row_map, valid_T, shape))
        if len(pieces) < piece.count:
            return out_TH
        routing = self.gate.batch_routing([(r, v, s) for r, _, v, s in pieces])
        valid_T = batch_order([v for _, _, v, _ in pieces], [s for *_, s in pieces])
        routed_E = sum(m.routed_E for _, m, _, _ in pieces)
        dropped = sum(m.dropped for _, m, _, _ in pieces)
        row_map = dataclasses.replace(pieces[0][1], routed_E=routed_E, dropped=dropped)
        pieces.clear()
        return self._attach_router_losses(out_TH, routing, row_map, valid_T)
