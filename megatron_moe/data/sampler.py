"""Deterministic, resumable batch samplers and data loaders (as in Megatron-LM).

Samples are consumed in index order (the GPT dataset's own shuffle index already
randomizes them). Each step takes ``micro_batch_size * data_parallel_size`` consecutive
indices and gives rank ``r`` the ``r``-th slice, so ranks never overlap and training
resumes exactly from ``consumed_samples``.
"""

from collections.abc import Iterator

import torch


def _check_common(
    total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int
) -> None:
    """Validate the arguments shared by both samplers."""
    if total_samples <= 0:
        raise ValueError(f"dataset has no samples (total_samples={total_samples}); check --data-path and --split")
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples={consumed_samples} must be >= 0")
    if micro_batch_size <= 0:
        raise ValueError(f"--micro-batch-size {micro_batch_size} must be >= 1")
    if data_parallel_size <= 0:
        raise ValueError(f"data_parallel_size={data_parallel_size} must be >= 1")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data_parallel_rank={data_parallel_rank} must be in [0, {data_parallel_size})")


class PretrainingSampler:
    """Yield this data-parallel rank's micro-batches of indices, from ``consumed_samples`` on.

    Args:
        total_samples: number of samples in the dataset.
        consumed_samples: samples already consumed by all ranks together (resume point).
        micro_batch_size: samples per rank per micro-batch.
        data_parallel_rank, data_parallel_size: this rank and the number of DP ranks.
        drop_last: drop a final incomplete global batch (else yield this rank's part of it).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        _check_common(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if consumed_samples >= total_samples:
            raise ValueError(f"no samples left: consumed_samples={consumed_samples} >= total_samples={total_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_micro_batch = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Number of micro-batches this rank will yield."""
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self.global_micro_batch)
        partial = rest > self.data_parallel_rank * self.micro_batch_size
        return full + int(not self.drop_last and partial)

    def _rank_slice(self, batch: list[int]) -> list[int]:
        """This rank's part of a global micro-batch."""
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start : start + self.micro_batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for index in range(self.consumed_samples, self.total_samples):
            batch.append(index)
            if len(batch) == self.global_micro_batch:
                yield self._rank_slice(batch)
                batch = []
        if batch and not self.drop_last and self._rank_slice(batch):
            yield self._rank_slice(batch)


class CyclicPretrainingSampler:
    """Like ``PretrainingSampler`` but endless: indices wrap around the dataset.

    Used for validation so any number of evaluation iterations works on a small split.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ):
        _check_common(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_micro_batch = micro_batch_size * data_parallel_size

    def __iter__(self) -> Iterator[list[int]]:
        position = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        while True:
            yield [(position + i) % self.total_samples for i in range(self.micro_batch_size)]
            position += self.global_micro_batch


def build_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
    cyclic: bool = False,
    pin_memory: bool = False,
) -> torch.utils.data.DataLoader:
    """A DataLoader over ``dataset`` for this DP rank, resumable from ``consumed_samples``.

    Batches are dicts of stacked tensors (for GPTDataset: tokens, labels, loss_mask,
    position_ids, plus dataset_id for blends). ``cyclic=True`` never ends (validation).
    ``pin_memory``: batches in page-locked memory (the platform's choice: on a GPU).
    """
    if dataset is None:
        raise ValueError("dataset is None: this split is empty (check --split) or is not built on this rank")
    if num_workers < 0:
        raise ValueError(f"--num-workers {num_workers} must be >= 0")
    sampler_type = CyclicPretrainingSampler if cyclic else PretrainingSampler
    batch_sampler = sampler_type(
        len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        # Its own generator: starting an iterator draws a worker seed, and drawing it
        # from the global RNG would shift dropout streams after a resume.
        generator=torch.Generator().manual_seed(0),
    )
