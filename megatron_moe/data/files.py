"""The data flags' files, checked before start-up without torch or megatron-core: they exist, each prefix's
``.idx`` header is sound, and its documents cover the splits the run reads (`check_data_files`, which
`config.parse_and_validate` runs with the flag checks, so that every error comes in one block). The split
arithmetic is megatron-core's, written out here to stay light (`split_matrix`; the tests hold it equal to
megatron-core's)."""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_moe.config.fields import Collector, require
from megatron_moe.config.rules_groups import valid_split
from megatron_moe.data import DataError

if TYPE_CHECKING:
    from megatron_moe.config import RunConfig

DATA_PATH_FLAG = "--data-path"
IDX_HEADER = b"MMIDIDX\x00\x00"
IDX_FIXED_BYTES = len(IDX_HEADER) + 8 + 1 + 8 + 8
"""megatron-core's IndexedDataset index: its magic, then version, dtype code, sequence and document counts."""


def read_idx_header(idx_path: str) -> tuple[int, int, int]:
    """(dtype code, sequence count, document count) of an ``.idx`` whose header and size agree."""
    corrupt = (
        f"{DATA_PATH_FLAG}: index file {idx_path} is truncated or corrupt; re-run tools/preprocess_data.py to "
        f"rebuild it"
    )
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as stream:
        head = stream.read(IDX_FIXED_BYTES)
    if len(head) < IDX_FIXED_BYTES or not head.startswith(IDX_HEADER):
        raise DataError(corrupt)
    version, code, seq_count, doc_count = struct.unpack("<QBQQ", head[len(IDX_HEADER) :])
    if version != 1 or size != IDX_FIXED_BYTES + seq_count * (4 + 8) + doc_count * 8:
        raise DataError(corrupt)
    return code, seq_count, doc_count


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """Each split's bookends as shares of the data, None for an empty one: megatron-core 0.16.1's
    `parse_and_normalize_split` then `convert_split_vector_to_split_matrix`, in the same float arithmetic."""
    shares = [float(share) for share in re.findall(r"[.0-9]+", split)]
    shares += [0.0] * (3 - len(shares))
    total = sum(shares)
    ends = [0.0]
    for share in shares:
        ends.append(ends[-1] + share / total)
    return [(begin, end) if end > begin else None for begin, end in zip(ends[:-1], ends[1:])]


def check_split_coverage(prefix: str, num_sequences: int, split: str, sizes: Sequence[int]) -> None:
    """Refuse a split asked for samples (``sizes``: train, valid, test) that gets none of the prefix's documents:
    megatron-core 0.16.1 would loop forever on it. Its arithmetic: each split's bookends are shares of the
    sequence count, rounded (`BlendedMegatronDatasetBuilder._build_megatron_dataset_splits`)."""
    for name, bookends, size in zip(("train", "valid", "test"), split_matrix(split), sizes):
        if bookends is None or size <= 0:
            continue
        begin = int(round(bookends[0] * num_sequences))
        end = int(round(bookends[1] * num_sequences))
        if end <= begin:
            raise DataError(
                f"--split {split}: the {name} split of {prefix} gets none of its {num_sequences} documents; give "
                f"it a larger share (e.g. --split 90,10,0), set its share to 0, or add documents"
            )


def check_data_files(cfg: RunConfig) -> None:
    """The files the data flags name exist, and each prefix's documents cover the splits the run reads (train;
    valid where it validates): looked for and counted from the .idx header, not read (their contents are
    checked as they load, after start-up), so that a wrong path or a split left empty is named with the other
    flag errors, before any process group or profile."""
    data = cfg.data
    errors = Collector()
    sizes = (1, int(cfg.training.eval_iters > 0), 0)
    prefixes = data.data_path[1::2] if len(data.data_path) > 1 else data.data_path  # a blend: W1 P1 W2 P2 ...
    for prefix in prefixes:
        missing = [path for path in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(path)]
        for path in missing:
            errors.add(
                f"{DATA_PATH_FLAG} {prefix}: missing {path}; give the prefix tools/preprocess_data.py wrote "
                "(PREFIX_text_document for --output-prefix PREFIX)"
            )
        if missing:
            continue
        try:
            num_sequences = read_idx_header(prefix + ".idx")[1]
            if valid_split(data.split):  # else named by the flag checks
                check_split_coverage(prefix, num_sequences, data.split, sizes)
        except DataError as error:
            errors.add(str(error))
    reads = ("--vocab-file", "--merge-file") if data.tokenizer_type == "GPT2BPETokenizer" else ("--tokenizer-model",)
    for flag in reads:
        path = getattr(data, flag[2:].replace("-", "_"))
        with errors:
            require(path is None or os.path.exists(path), flag, path, "no such file or directory")
    errors.raise_all()
