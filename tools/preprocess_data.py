#!/usr/bin/env python
"""Tokenize documents into megatron-core IndexedDataset files (Megatron-LM compatible).

Writes ``{output_prefix}_{key}_document.bin/.idx`` for every ``--json-keys`` key, one
IndexedDataset document per input document, in input order whatever ``--workers`` is, and
beside them the metadata sidecar ``.meta.json`` that training start-up reads instead of
scanning the ``.bin`` (largest token id, counts, the tokenizer's identity; see
``megatron_moe/data/metadata.py``). Files are written under temporary names and renamed at
the end, so an interrupted run never leaves a half-written file behind.

``--write-metadata PREFIX ...`` writes only the sidecar of existing data (e.g. made by
Megatron-LM's preprocess_data.py): one scan of each ``.bin``, checked against the tokenizer.

The tokenizer flags are training's (``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file``,
``--merge-file``) and build the same tokenizer (``megatron_moe.data.tokenizer.build_tokenizer``).

Examples:
    python -m tools.preprocess_data --input data/stdlib.jsonl \
        --tokenizer-model data/tokenizer.model --output-prefix data/stdlib --append-eod
    python -m tools.preprocess_data --input data/stdlib.jsonl --tokenizer-type GPT2BPETokenizer \
        --vocab-file data/bpe/vocab.json --merge-file data/bpe/merges.txt --output-prefix data/stdlib_bpe --append-eod
    python -m tools.preprocess_data --write-metadata data/corpus_text_document \
        --tokenizer-model data/tokenizer.model
"""

import argparse
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from functools import lru_cache

if __name__ == "__main__":  # before megatron-core's imports: its no-TE/apex and legacy-tokenizer notices filtered
    from megatron_moe.failure import setup_logging

    setup_logging()

import numpy  # noqa: E402
import torch  # noqa: E402
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402

from megatron_moe.config import (  # noqa: E402
    TOKENIZER_FIELDS,
    ConfigError,
    DataConfig,
    add_tokenizer_arguments,
    tokenizer_config,
)
from megatron_moe.data import DataError, expand_input_paths, iter_documents  # noqa: E402
from megatron_moe.data.datasets import check_prefix_files, check_vocabulary_covers  # noqa: E402
from megatron_moe.data.metadata import (  # noqa: E402
    TokenizerIdentity,
    TokenMetadata,
    metadata_path,
    scan_max_token_id,
    write_metadata,
)
from megatron_moe.data.tokenizer import Tokenizer, build_tokenizer  # noqa: E402

CHUNK_SIZE = 16


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input",
        nargs="+",
        help="files, directories or globs; .jsonl/.json are JSON lines, any other file is one document",
    )
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="JSON keys to tokenize, one output dataset each"
    )
    parser.add_argument("--output-prefix", help="writes OUTPUT_PREFIX_{key}_document.bin/.idx/.meta.json")
    parser.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--log-interval", type=int, default=1000, help="print progress every this many documents")
    parser.add_argument(
        "--write-metadata",
        nargs="+",
        metavar="PREFIX",
        help="instead of tokenizing: scan existing PREFIX.bin/.idx once and write "
        "PREFIX.meta.json (for data made without this tool)",
    )
    add_tokenizer_arguments(parser)
    return parser


def validate_args(args: argparse.Namespace) -> None:
    """Reject bad numeric arguments with a message naming the flag."""
    if args.workers < 1:
        raise SystemExit(f"--workers {args.workers} must be >= 1 (e.g. --workers 2)")
    if args.log_interval < 1:
        raise SystemExit(f"--log-interval {args.log_interval} must be >= 1 (e.g. 1000)")
    if args.write_metadata:
        if args.input or args.output_prefix:
            raise SystemExit(
                "--write-metadata describes existing data; drop --input and --output-prefix "
                "(or run without --write-metadata to tokenize)"
            )
    elif not args.input or not args.output_prefix:
        missing = "--input" if not args.input else "--output-prefix"
        raise SystemExit(
            f"{missing} is required (e.g. --input data/stdlib.jsonl --output-prefix data/stdlib), "
            f"unless --write-metadata PREFIX describes existing data"
        )


@lru_cache(maxsize=4)
def _tokenizer(flags: tuple[str | None, ...]) -> Tokenizer:
    """The tokenizer the tokenizer flags' values (in ``TOKENIZER_FIELDS`` order) name, loaded once per process."""
    return build_tokenizer(DataConfig(**dict(zip(TOKENIZER_FIELDS, flags))))


def tokenizer_flags(data: DataConfig) -> tuple[str | None, ...]:
    """The tokenizer flags' values, hashable: what a worker task carries to build its tokenizer."""
    return tuple(getattr(data, name) for name in TOKENIZER_FIELDS)


def encode_document(task: tuple[tuple, bool, dict[str, str]]) -> tuple[dict[str, numpy.ndarray], int]:
    """Tokenize one document; return ``({key: ids}, utf-8 bytes read)``."""
    flags, append_eod, document = task
    tokenizer = _tokenizer(flags)
    encoded = {}
    num_bytes = 0
    for key, text in document.items():
        ids = tokenizer.tokenize(text)
        if append_eod:
            ids.append(tokenizer.eod)
        encoded[key] = numpy.asarray(ids, dtype=numpy.int64)
        num_bytes += len(text.encode("utf-8"))
    return encoded, num_bytes


def _pool_context():
    """Fork where available: workers then skip re-importing torch and megatron-core."""
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context()


def encoded_documents(tasks: Iterable, workers: int) -> Iterator[tuple[dict, int]]:
    """Encode tasks in order, in this process or in a pool of ``workers`` processes."""
    if workers == 1:
        yield from map(encode_document, tasks)
        return
    with _pool_context().Pool(workers) as pool:
        yield from pool.imap(encode_document, tasks, chunksize=CHUNK_SIZE)


def output_paths(output_prefix: str, key: str) -> tuple[str, str]:
    """Final ``.bin`` and ``.idx`` paths for one key."""
    prefix = f"{output_prefix}_{key}_document"
    return prefix + ".bin", prefix + ".idx"


def sidecar_path(output_prefix: str, key: str) -> str:
    """Final path of one key's metadata sidecar."""
    return metadata_path(f"{output_prefix}_{key}_document")


def temporary_path(path: str) -> str:
    """The name a file is written under before being renamed into place."""
    return f"{path}.tmp{os.getpid()}"


class ProgressLog:
    """Megatron-style progress lines on stderr."""

    def __init__(self, interval: int):
        self.interval = interval
        self.start = time.time()
        self.documents = 0
        self.bytes = 0

    def update(self, num_bytes: int) -> None:
        """Count one document; print every ``interval`` documents."""
        self.documents += 1
        self.bytes += num_bytes
        if self.documents % self.interval == 0:
            self.report()

    def report(self) -> None:
        """Print ``Processed N documents (X docs/s, Y MB/s).``"""
        elapsed = max(time.time() - self.start, 1e-9)
        print(
            f"Processed {self.documents} documents ({self.documents / elapsed:.1f} docs/s, "
            f"{self.bytes / elapsed / 1024 / 1024:.2f} MB/s).",
            file=sys.stderr,
            flush=True,
        )


def write_datasets(
    args: argparse.Namespace, data: DataConfig, tokenizer: Tokenizer, paths: list[str]
) -> dict[str, int]:
    """Tokenize all documents into temporary files, sidecars included; return token counts per key."""
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = {
        key: IndexedDatasetBuilder(temporary_path(output_paths(args.output_prefix, key)[0]), dtype=dtype)
        for key in args.json_keys
    }
    tokens = {key: 0 for key in args.json_keys}
    documents = {key: 0 for key in args.json_keys}
    max_ids = {key: -1 for key in args.json_keys}
    flags = tokenizer_flags(data)
    tasks = ((flags, args.append_eod, doc) for doc in iter_documents(paths, args.json_keys))
    progress = ProgressLog(args.log_interval)
    for encoded, num_bytes in encoded_documents(tasks, args.workers):
        for key, ids in encoded.items():
            if ids.size:
                builders[key].add_item(torch.from_numpy(ids))
                builders[key].end_document()
                tokens[key] += int(ids.size)
                documents[key] += 1
                max_ids[key] = max(max_ids[key], int(ids.max()))
        progress.update(num_bytes)
    progress.report()
    empty = [key for key, count in documents.items() if count == 0]
    if empty:
        raise DataError(
            f"--input {' '.join(args.input)}: no documents with tokens for --json-keys {' '.join(empty)} (0 tokens "
            f"from {progress.documents} documents); give .jsonl lines with a non-empty {empty[0]!r} string, or "
            f"non-empty text files"
        )
    identity = TokenizerIdentity.of(tokenizer)
    for key, builder in builders.items():
        builder.finalize(temporary_path(output_paths(args.output_prefix, key)[1]))
        write_metadata(
            temporary_path(sidecar_path(args.output_prefix, key)),
            TokenMetadata(
                dtype=numpy.dtype(dtype).name,
                num_tokens=tokens[key],
                num_sequences=documents[key],
                num_documents=documents[key],
                bin_bytes=tokens[key] * numpy.dtype(dtype).itemsize,
                max_token_id=max_ids[key],
                tokenizer=identity,
                written_by="tools/preprocess_data.py",
            ),
        )
    return tokens


def remove_temporaries(args: argparse.Namespace) -> None:
    """Delete this run's temporary files (after a failure)."""
    for key in args.json_keys:
        for path in (*output_paths(args.output_prefix, key), sidecar_path(args.output_prefix, key)):
            if os.path.exists(temporary_path(path)):
                os.remove(temporary_path(path))


def publish(args: argparse.Namespace) -> None:
    """Rename the temporary files into place: .bin, then the .idx, then the sidecar describing both.

    An old sidecar goes first, so an interruption leaves new data without one (start-up warns),
    never new data with a sidecar that describes the old.
    """
    for key in args.json_keys:
        sidecar = sidecar_path(args.output_prefix, key)
        if os.path.exists(sidecar):
            os.remove(sidecar)
        for path in (*output_paths(args.output_prefix, key), sidecar):
            os.replace(temporary_path(path), path)


def describe_existing(prefix: str, tokenizer: Tokenizer) -> TokenMetadata:
    """``--write-metadata``: scan ``PREFIX.bin`` once and write ``PREFIX.meta.json``."""
    try:
        files = check_prefix_files(prefix)
        max_id = scan_max_token_id(prefix + ".bin", numpy.dtype(files.dtype), files.num_tokens)
        check_vocabulary_covers(max_id, tokenizer.vocab_size, prefix + ".bin")
    except DataError as error:
        raise DataError(f"--write-metadata {prefix}: {error}") from error
    metadata = TokenMetadata(
        **asdict(files),
        max_token_id=max_id,
        tokenizer=TokenizerIdentity.of(tokenizer),
        written_by="tools/preprocess_data.py --write-metadata",
    )
    write_metadata(metadata_path(prefix), metadata)
    print(f"Wrote {metadata_path(prefix)} ({files.num_tokens} tokens, max id {max_id})", file=sys.stderr)
    return metadata


def main(argv: list[str] | None = None) -> dict[str, int]:
    """Run preprocessing; return the number of tokens written per key (per prefix with --write-metadata)."""
    args = build_parser().parse_args(argv)
    validate_args(args)
    try:
        data = tokenizer_config(args, argv)
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from None
    tokenizer = build_tokenizer(data)
    if args.write_metadata:
        return {prefix: describe_existing(prefix, tokenizer).num_tokens for prefix in args.write_metadata}
    paths = expand_input_paths(args.input, flag="--input")
    folder = os.path.dirname(os.path.abspath(args.output_prefix))
    created = not os.path.isdir(folder)
    os.makedirs(folder, exist_ok=True)
    try:
        tokens = write_datasets(args, data, tokenizer, paths)
    except BaseException:
        remove_temporaries(args)
        if created and not os.listdir(folder):  # nothing left behind, not even the folder
            os.rmdir(folder)
        raise
    publish(args)
    for key, count in tokens.items():
        print(
            f"Wrote {count} tokens to {output_paths(args.output_prefix, key)[0]} (and .idx, .meta.json)",
            file=sys.stderr,
        )
    return tokens


if __name__ == "__main__":
    try:
        main()
    except DataError as error:  # one line, exit code 2 as training's data errors; nothing was published
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
