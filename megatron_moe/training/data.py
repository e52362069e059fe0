"""The run's tokenizer, datasets and iterators, positioned by the training state."""

from __future__ import annotations

import dataclasses

from megatron.core import parallel_state

from megatron_moe.config import RunConfig
from megatron_moe.data.datasets import build_gpt_datasets, build_mock_gpt_datasets
from megatron_moe.data.sampler import build_data_loader
from megatron_moe.platform import current_platform
from megatron_moe.training.summary import dataset_sizes


@dataclasses.dataclass
class RunData:
    train_iterator: object
    _valid_dataset: object
    _loader_args: dict
    sizes: dict = dataclasses.field(default_factory=dict)
    """Split -> (documents, sequences) or None (`summary.dataset_sizes`), for the start-up summary."""
    record: dict | None = None
    """The data's `data_record` (data/fingerprint.py), saved in each checkpoint."""

    def valid_iterator(self):
        """A fresh iterator over the same validation batches (comparable across evaluations)."""
        if self._valid_dataset is None:
            return None
        return iter(build_data_loader(self._valid_dataset, 0, cyclic=True, **self._loader_args))


def build_run_data(cfg: RunConfig, tokenizer, consumed_train_samples: int, record: dict | None = None) -> RunData:
    """Datasets for this run; the train iterator resumes after `consumed_train_samples`; `record`: the data's
    `data_record`, kept for the checkpoints."""
    t = cfg.training
    gbs = t.global_batch_size
    common = dict(
        tokenizer=tokenizer,
        seq_length=cfg.model.seq_length,
        seed=t.seed,
        train_samples=max(t.train_iters, 1) * gbs,
        valid_samples=t.eval_iters * gbs if t.eval_iters else 0,
        test_samples=0,
        cache_dir=cfg.data.data_cache_path,
        is_built_on_rank=lambda: True,
    )
    if cfg.data.mock_data:
        train, valid, _ = build_mock_gpt_datasets(**common)
    else:
        train, valid, _ = build_gpt_datasets(data_path=cfg.data.data_path, split=cfg.data.split, **common)
    args = loader_args(cfg)
    train_iterator = None
    if consumed_train_samples < t.train_iters * gbs:
        train_iterator = iter(build_data_loader(train, consumed_train_samples, **args))
    sizes = {"train": dataset_sizes(train), "valid": dataset_sizes(valid)}
    return RunData(train_iterator, valid, args, sizes, record)


def loader_args(cfg: RunConfig) -> dict:
    """This rank's data loader settings: its data-parallel slice, workers, and pinned batches where the platform
    copies them to a GPU (`get_batch`'s non-blocking copy then does not wait for queued device work)."""
    return dict(
        micro_batch_size=cfg.training.micro_batch_size,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        num_workers=cfg.data.num_workers,
        pin_memory=current_platform().pin_memory,
    )
