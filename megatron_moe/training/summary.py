"""The start-up summary: what this run is (layout, parameters, data, tokenizer, what it will train), logged once."""

from __future__ import annotations

import logging

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_moe import comm
from megatron_moe.checkpointing.hf_families import startup_note
from megatron_moe.config import RunConfig
from megatron_moe.data.datasets import MOCK_SPLIT
from megatron_moe.model.fusions import Fusions
from megatron_moe.platform import current_platform
from megatron_moe.training.flops import inactive_params_per_token

log = logging.getLogger("megatron_moe")


def parameter_counts(cfg: RunConfig, model) -> dict[str, int]:
    """{"total", "active_per_token", "this_rank"}: every parameter of the model once (a collective: every rank
    calls it), those one token meets, and this rank's. A parameter counts on the first of its replicas: not a
    tied copy; a dense one on TP rank 0 unless TP splits it, data-parallel rank 0; an expert's (split over ESP,
    never copied over TP) on expert-data-parallel rank 0."""
    params = [p for chunk in model for p in chunk.parameters()]
    dense_first = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    expert_first = parallel_state.get_expert_data_parallel_rank() == 0

    def first_copy(p) -> bool:
        if not getattr(p, "allreduce", True):  # an expert's
            return expert_first
        return dense_first and param_is_not_tensor_parallel_duplicate(p)

    unique = sum(p.numel() for p in params if param_is_not_shared(p) and first_copy(p))
    total = torch.tensor([unique], dtype=torch.float64, device=current_platform().device)
    total = int(comm.count_parameters(total).item())
    return {
        "total": total,
        "active_per_token": total - inactive_params_per_token(cfg),
        "this_rank": sum(p.numel() for p in params),
    }


def dataset_sizes(dataset) -> tuple[int, int] | None:
    """(documents, sequences) of a megatron-core GPT dataset or a blend of them (None: no such split)."""
    if dataset is None:
        return None
    parts = getattr(dataset, "datasets", None) or [dataset]
    return sum(len(part.indices) for part in parts), len(dataset)


def log_startup_summary(cfg: RunConfig, counts: dict[str, int], tokenizer, splits: dict, fusions: Fusions) -> None:
    """The summary lines (rank 0): parameters, megatron-core's fusions on and off, data and tokenizer, split sizes,
    the plan in steps and samples; with --save, a note when HuggingFace export would refuse the model."""
    t = cfg.training
    log.info(
        "parameters: %d total, %d active per token, %d on this rank",
        counts["total"],
        counts["active_per_token"],
        counts["this_rank"],
    )
    log.info("fusions: %s", fusions.describe())
    log.info(
        "data: %s (split %s); tokenizer: %s, vocabulary %d",
        "megatron-core's mock data (MockGPTDataset)" if cfg.data.mock_data else " ".join(cfg.data.data_path),
        MOCK_SPLIT if cfg.data.mock_data else cfg.data.split,
        tokenizer.description,
        tokenizer.vocab_size,
    )
    for name, sizes in splits.items():
        if sizes is not None:
            log.info("dataset %s: %d documents, %d sequences of %d tokens", name, *sizes, cfg.model.seq_length)
    log.info(
        "training: %d iterations x global batch %d = %d samples (%d tokens)",
        t.train_iters,
        t.global_batch_size,
        t.train_iters * t.global_batch_size,
        t.train_iters * t.global_batch_size * cfg.model.seq_length,
    )
    note = startup_note(cfg)
    if note:
        log.info("%s", note)
