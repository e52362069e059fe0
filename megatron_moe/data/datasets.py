"""Tokenized data validation and megatron-core GPT dataset building.

Tokenized data is megatron-core's IndexedDataset format: ``PREFIX.bin`` (token ids) and
``PREFIX.idx`` (lengths, offsets, document boundaries), written by
``tools/preprocess_data.py`` with a metadata sidecar ``PREFIX.meta.json`` (see
``megatron_moe.data.metadata``). Start-up reads the ``.idx`` and the sidecar, not the
``.bin``'s tokens (only a prefix without a sidecar is scanned, once, its result cached), so it
does not grow with the corpus. megatron-core's index cache is keyed by each prefix's contents
(`GPTDataset`). ``--data-path`` takes one prefix or a blend ``W1 PREFIX1 W2 PREFIX2 ...``.
"""

import copy
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy
import torch
from megatron.core.datasets import gpt_dataset
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset
from megatron.core.utils import log_single_rank

from megatron_moe.config.rules_groups import valid_split
from megatron_moe.data import DataError
from megatron_moe.data.files import DATA_PATH_FLAG, check_split_coverage, read_idx_header
from megatron_moe.data.fingerprint import fingerprint_prefix
from megatron_moe.data.metadata import (
    WRITE_HINT,
    TokenizerIdentity,
    TokenMetadata,
    metadata_path,
    read_metadata,
    scan_max_token_id,
)
from megatron_moe.files import write_json_atomic

PREPROCESS_HINT = (
    "create it with: python -m tools.preprocess_data --input CORPUS.jsonl "
    "--tokenizer-model TOKENIZER.model --output-prefix PREFIX --append-eod "
    "(--data-path then takes PREFIX_text_document)"
)
log = logging.getLogger("megatron_moe")


# ------------------------------------------------------------------------ --data-path


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Parse ``--data-path``: ``PREFIX`` or ``W1 PREFIX1 W2 PREFIX2 ...``.

    Returns ``(prefixes, weights)``; weights is None for a single unweighted prefix.
    """
    if not data_path:
        raise DataError(
            f"{DATA_PATH_FLAG} is empty; pass a prefix such as "
            f"data/corpus_text_document or a blend '0.7 PREFIX1 0.3 PREFIX2'"
        )
    if len(data_path) == 1:
        return [data_path[0]], None
    if len(data_path) % 2:
        raise DataError(
            f"{DATA_PATH_FLAG} {' '.join(data_path)}: a blend needs weight/prefix "
            f"pairs but got {len(data_path)} values; e.g. '0.7 PREFIX1 0.3 PREFIX2'"
        )
    weights = [_parse_weight(w, data_path) for w in data_path[0::2]]
    if sum(weights) <= 0:
        raise DataError(
            f"{DATA_PATH_FLAG} {' '.join(data_path)}: the weights sum to zero; give at least one positive weight"
        )
    return list(data_path[1::2]), weights


def _parse_weight(value: str, data_path: list[str]) -> float:
    """Parse one blend weight (a non-negative number)."""
    try:
        weight = float(value)
    except ValueError:
        weight = -1.0
    if not weight >= 0.0:
        raise DataError(
            f"{DATA_PATH_FLAG} {' '.join(data_path)}: blend weight {value!r} is not "
            f"a non-negative number; use 'W1 PREFIX1 W2 PREFIX2 ...' "
            f"e.g. '0.7 PREFIX1 0.3 PREFIX2'"
        )
    return weight


# --------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class DataSummary:
    """What ``validate_data_prefix`` found in one prefix."""

    prefix: str
    num_documents: int
    num_sequences: int
    num_tokens: int
    max_token_id: int
    """From the metadata sidecar, else from one scan of the ``.bin`` (`scanned_max_token_id`); -1: no tokens."""


def _read_idx_counts(idx_path: str) -> tuple[type, int, int]:
    """Read and check the ``.idx`` header; return (dtype, sequence count, document count)."""
    code, seq_count, doc_count = read_idx_header(idx_path)
    if code not in {d.value for d in DType}:
        raise DataError(
            f"{DATA_PATH_FLAG}: index file {idx_path} is truncated or corrupt (dtype code {code}); re-run "
            f"tools/preprocess_data.py to rebuild it"
        )
    return DType.dtype_from_code(code), seq_count, doc_count


def _idx_token_count(prefix: str, idx_path: str, itemsize: int) -> int:
    """Tokens the ``.idx`` says the ``.bin`` holds: the sum of its sequence lengths (reads the .idx only).

    Also checks the ``.idx``'s own arrays, O(.idx): each sequence starts where the previous one
    ends (byte offsets = the running sum of lengths x item size), and the document boundaries
    run from 0 to the sequence count without going back.
    """
    try:
        dataset = IndexedDataset(prefix, mmap=True)
    except (AssertionError, ValueError) as error:
        raise DataError(
            f"{DATA_PATH_FLAG}: index file {idx_path} is corrupt ({error}); "
            f"re-run tools/preprocess_data.py to rebuild it"
        ) from error
    index = dataset.index
    lengths = index.sequence_lengths.astype(numpy.int64)
    starts = numpy.concatenate(([0], numpy.cumsum(lengths * itemsize)[:-1]))
    offsets = index.sequence_pointers.astype(numpy.int64)
    documents = index.document_indices.astype(numpy.int64)
    count = int(lengths.sum())
    del dataset, index
    mismatch = numpy.flatnonzero(offsets != starts)
    if mismatch.size:
        i = int(mismatch[0])
        raise DataError(
            f"{DATA_PATH_FLAG}: index file {idx_path} is corrupt (sequence {i} starts at byte {offsets[i]} "
            f"of the .bin, but the sequences before it end at byte {starts[i]}); "
            f"re-run tools/preprocess_data.py to rebuild it"
        )
    if documents[0] != 0 or documents[-1] != len(lengths) or (numpy.diff(documents) < 0).any():
        raise DataError(
            f"{DATA_PATH_FLAG}: index file {idx_path} is corrupt (its document boundaries do not run "
            f"from 0 to its {len(lengths)} sequences in order); re-run tools/preprocess_data.py to rebuild it"
        )
    return count


@dataclass(frozen=True, kw_only=True)
class PrefixFiles:
    """What the ``.idx`` (and the ``.bin``'s size) of one prefix say: the sidecar's counts."""

    dtype: str
    num_tokens: int
    num_sequences: int
    num_documents: int
    bin_bytes: int


def check_prefix_files(prefix: str) -> PrefixFiles:
    """Check that ``PREFIX.bin/.idx`` exist and are intact; reads the ``.idx``, not the ``.bin``."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    for path in (bin_path, idx_path):
        if not os.path.isfile(path):
            raise DataError(f"{DATA_PATH_FLAG} {prefix}: missing {path}; {PREPROCESS_HINT}")
    dtype, seq_count, doc_count = _read_idx_counts(idx_path)
    if seq_count == 0:
        raise DataError(f"{DATA_PATH_FLAG} {prefix}: {idx_path} holds no documents; {PREPROCESS_HINT}")
    num_tokens = _idx_token_count(prefix, idx_path, numpy.dtype(dtype).itemsize)
    bin_bytes = os.path.getsize(bin_path)
    expected = num_tokens * numpy.dtype(dtype).itemsize  # = the last offset + the last size, checked above
    if bin_bytes != expected:
        raise DataError(
            f"{DATA_PATH_FLAG}: data file {bin_path} is truncated or corrupt "
            f"({bin_bytes} bytes, its index expects {expected}); "
            f"re-run tools/preprocess_data.py to rebuild it"
        )
    return PrefixFiles(
        dtype=numpy.dtype(dtype).name,
        num_tokens=num_tokens,
        num_sequences=seq_count,
        num_documents=doc_count - 1,
        bin_bytes=bin_bytes,
    )


def _check_metadata(metadata: TokenMetadata, prefix: str, files: PrefixFiles) -> None:
    """Refuse a sidecar that does not describe this ``.bin/.idx`` (e.g. left from older data)."""
    stale = [
        f"{name}: metadata {getattr(metadata, name)}, data {value}"
        for name, value in asdict(files).items()
        if getattr(metadata, name) != value
    ]
    if stale:
        raise DataError(
            f"{DATA_PATH_FLAG} {prefix}: {metadata_path(prefix)} does not describe "
            f"{prefix}.bin/.idx ({'; '.join(stale)}); it is stale: rewrite it with: "
            f"{WRITE_HINT.format(prefix=prefix)}"
        )


def validate_data_prefix(
    prefix: str, vocab_size: int, tokenizer: TokenizerIdentity | None = None, *, cache_dir: str | None = None
) -> DataSummary:
    """Check that ``PREFIX.bin/.idx`` exist, are intact and fit a ``vocab_size`` tokenizer.

    Reads the ``.idx`` and the metadata sidecar (``PREFIX.meta.json``), not the ``.bin``'s tokens: the
    ``.bin``'s size is checked against the ``.idx``, its largest token id comes from the sidecar. Without a
    sidecar the ``.bin`` is scanned once for it (`scanned_max_token_id`, cached under `cache_dir`) and a warning
    says how to write the sidecar. With `tokenizer` (the identity of ``--tokenizer-model``), a sidecar recording
    another vocabulary (larger, smaller, or the same size with other pieces) is refused.
    """
    files = check_prefix_files(prefix)
    metadata = read_metadata(prefix)
    if metadata is None:
        max_id, cached = scanned_max_token_id(prefix, files, cache_dir)
        log_single_rank(
            log,
            logging.WARNING,
            f"{DATA_PATH_FLAG} {prefix}: no {metadata_path(prefix)}, so the tokenizer it was made with is not "
            f"known; its largest token id is {max_id} ({cached}); write the file once with: "
            f"{WRITE_HINT.format(prefix=prefix)}",
        )
    else:
        _check_metadata(metadata, prefix, files)
        if tokenizer is not None:
            check_same_vocabulary(metadata.tokenizer, tokenizer, prefix)
        max_id = metadata.max_token_id
    check_vocabulary_covers(max_id, vocab_size, prefix + ".bin")
    return DataSummary(prefix, files.num_documents, files.num_sequences, files.num_tokens, max_id)


SCAN_CACHE = "max_token_id"
"""The folder of the token-id scans' results, in the index cache's (--data-cache-path, else PREFIX/cache)."""


def scanned_max_token_id(prefix: str, files: PrefixFiles, cache_dir: str | None) -> tuple[int, str]:
    """(The largest token id of a prefix without a sidecar, where it came from): read once with numpy, chunk by
    chunk, from the memory-mapped ``.bin``, then from its cache file, keyed by the prefix's fingerprint (a
    rebuilt prefix is scanned again). A cache that cannot be read is scanned over; one that cannot be written
    is said and the scan repeats at the next start."""
    digest = fingerprint_prefix(prefix).digest
    path = os.path.join(cache_dir or os.path.join(prefix, "cache"), SCAN_CACHE, f"{digest}.json")
    try:
        with open(path, encoding="utf-8") as stream:
            return int(json.load(stream)["max_token_id"]), f"an earlier scan's, from {path}"
    except (OSError, ValueError, LookupError, TypeError):
        pass
    max_id = scan_max_token_id(prefix + ".bin", numpy.dtype(files.dtype), files.num_tokens)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json_atomic(path, {"prefix": prefix, "max_token_id": max_id})
    except OSError as error:
        return max_id, f"scanned; not cached, {path}: {error.strerror or error}: scanned again at the next start"
    return max_id, f"scanned once, cached in {path}"


def check_vocabulary_covers(max_token_id: int, vocab_size: int, bin_path: str) -> None:
    """Refuse a tokenizer whose vocabulary does not cover the data's largest token id."""
    if max_token_id >= vocab_size:
        raise DataError(
            f"tokenizer vocabulary ({vocab_size}) smaller than the data's token ids "
            f"(max {max_token_id}) in {bin_path}; use the tokenizer the data was "
            f"preprocessed with (--tokenizer-model, or --vocab-file/--merge-file)"
        )


def check_same_vocabulary(data: TokenizerIdentity, given: TokenizerIdentity, prefix: str) -> None:
    """Refuse a tokenizer whose vocabulary is not the one the data was made with.

    The pieces in id order decide (the model file's bytes may differ for the same vocabulary)."""
    where = f"{given.flags} and {DATA_PATH_FLAG} {prefix}"
    fix = "use the tokenizer the data was made with, or re-run tools/preprocess_data.py with this one"
    if data.vocab_size != given.vocab_size:
        raise DataError(
            f"{where}: the tokenizer has {given.vocab_size} pieces but the data was made with a "
            f"{data.vocab_size}-piece vocabulary ({data.model_file}, per {metadata_path(prefix)}); {fix}"
        )
    if data.pieces_sha256 != given.pieces_sha256:
        raise DataError(
            f"{where}: same size ({given.vocab_size}) but other pieces: the tokenizer's pieces hash "
            f"{given.pieces_sha256[:12]}, the data's ({data.model_file}, per {metadata_path(prefix)}) "
            f"{data.pieces_sha256[:12]}; {fix}"
        )


# ----------------------------------------------------------------------------- building


class _Builder(BlendedMegatronDatasetBuilder):
    """megatron-core's builder, usable for blends without torch.distributed.

    megatron-core 0.16.1's BlendedDataset calls ``torch.distributed.get_rank()`` on a cache
    miss even when no process group exists. Without one, blend indices (cheap to build) are
    therefore not cached; GPTDataset indices still are.
    """

    @staticmethod
    def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):
        """Drop ``path_to_cache`` for BlendedDataset when torch.distributed is not set up."""
        if cls is BlendedDataset and not torch.distributed.is_initialized():
            *rest, config = args
            config = copy.copy(config)
            config.path_to_cache = None
            args = (*rest, config)
        return BlendedMegatronDatasetBuilder.build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args)


class GPTDataset(gpt_dataset.GPTDataset):
    """megatron-core's GPTDataset with its index cache keyed by the contents of its prefix, not only its path.

    megatron-core 0.16.1's key (`unique_description_hash`) names the prefix's path, the split and the sizes: a
    prefix rebuilt in place read the indices made for its old documents (other sample counts, and an IndexError
    at step 1 when it shrank). Its fingerprint (data/fingerprint.py) joins the key, so other contents build and
    cache their own indices. The same class name keeps megatron-core's file names and its default directory,
    PREFIX/cache/GPTDataset_indices. Each prefix is fingerprinted once, as its low-level dataset is opened.
    """

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        dataset = gpt_dataset.GPTDataset.build_low_level_dataset(dataset_path, config)
        dataset.fingerprint = fingerprint_prefix(dataset_path)
        return dataset

    def _build_document_sample_shuffle_indices(self):
        # megatron-core's MegatronDataset.__init__ has just made the key; it is remade with the fingerprint
        # before its one use, the cache's file names (a BlendedDataset's key reads these identifiers too).
        self.unique_identifiers["data_fingerprint"] = self.dataset.fingerprint.digest
        self.unique_description = json.dumps(
            self.unique_identifiers, indent=4, default=lambda obj: obj.unique_identifiers
        )
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8"), usedforsecurity=False
        ).hexdigest()
        return super()._build_document_sample_shuffle_indices()


def check_split(split: str) -> None:
    """Check ``--split``: up to three comma-separated non-negative shares, not all zero."""
    if not valid_split(split):
        raise DataError(
            f"--split {split!r}: expected up to three comma-separated non-negative "
            f"train,valid,test shares, e.g. --split 98,2,0"
        )


def _gpt_config(tokenizer, seq_length: int, seed: int, cache_dir: str | None, sizes: list[int], *, blend, split):
    """megatron-core's GPTDatasetConfig as Megatron-LM's pretrain_gpt.py makes it (no reset or mask options), for
    real data (a blend and a split) or mock data (neither).

    A split asked for no samples (--eval-iters 0: no validation) is not built, as Megatron-LM leaves it unused:
    its documents may be none at all (megatron-core 0.16.1 would loop forever on them), which is no error then.
    The other splits keep their documents."""
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    config.split_matrix = [bookends if size > 0 else None for bookends, size in zip(config.split_matrix, sizes)]
    return config


def build_gpt_datasets(
    *,
    data_path: list[str],
    split: str,
    tokenizer,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int,
    test_samples: int,
    cache_dir: str | None,
    is_built_on_rank: Callable[[], bool],
):
    """Build (train, valid, test) GPT datasets with megatron-core; None for an empty split.

    Call on every rank. With torch.distributed initialized, rank 0 builds and caches the
    indices in ``cache_dir`` first and the other ranks read them after a barrier; ranks
    where ``is_built_on_rank()`` is False get None. Without torch.distributed the datasets
    are built in this process. ``cache_dir=None`` uses megatron-core's default cache
    location, the directory ``PREFIX/cache/GPTDataset_indices``.
    """
    prefixes, weights = parse_data_path(data_path)
    check_split(split)
    if seq_length < 1:
        raise DataError(f"--seq-length {seq_length} must be >= 1 (e.g. 512)")
    counts = {"train": train_samples, "valid": valid_samples, "test": test_samples}
    for name, count in counts.items():
        if count < 0:
            raise DataError(
                f"{name}_samples={count} must be >= 0 (check --train-iters, --eval-iters and the batch sizes)"
            )
    sizes = [train_samples, valid_samples, test_samples]
    config = _gpt_config(tokenizer, seq_length, seed, cache_dir, sizes, blend=(prefixes, weights), split=split)
    identity = TokenizerIdentity.of(tokenizer)
    for prefix in prefixes:
        summary = validate_data_prefix(prefix, tokenizer.vocab_size, identity, cache_dir=cache_dir)
        check_split_coverage(prefix, summary.num_sequences, split, sizes)
    train, valid, test = _Builder(GPTDataset, sizes, is_built_on_rank, config).build()
    return train, valid, test


MOCK_SPLIT = "1,1,1"
"""megatron-core's split of --mock-data's documents: a config without a blend is mock data, split evenly
(`BlendedMegatronDatasetConfig.__post_init__`), whatever --split says, as in Megatron-LM."""


def build_mock_gpt_datasets(
    *,
    tokenizer,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int,
    test_samples: int,
    cache_dir: str | None,
    is_built_on_rank: Callable[[], bool],
):
    """(train, valid, test) of megatron-core's MockGPTDataset (--mock-data), as Megatron-LM builds them: no blend,
    so the config is mock and splits 1,1,1; the documents (its 100,000, of random length up to 4,096 tokens) count
    1, 2, 3, ... modulo the tokenizer's vocabulary, then its eod; a split asked for no samples is None."""
    sizes = [train_samples, valid_samples, test_samples]
    config = _gpt_config(tokenizer, seq_length, seed, cache_dir, sizes, blend=None, split=None)
    assert config.mock and config.split == MOCK_SPLIT, "megatron-core's config without a blend is its mock data"
    return tuple(_Builder(MockGPTDataset, sizes, is_built_on_rank, config).build())
