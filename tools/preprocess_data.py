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
import contextlib
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from functools import lru_cache

from megatron_moe.config import add_tokenizer_arguments
from tools.cli import HelpFormatter

CHUNK_SIZE = 16


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser (the standard library and megatron_moe.config only: `--help` is instant)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
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
    parser.add_argument(
        "--progress-seconds",
        type=float,
        default=2.0,
        help="a progress line (documents and bytes per second, share read and ETA) at most this often, on stderr; "
        "0: none, only the summary at the end",
    )
    parser.add_argument(
        "--log-interval",
        type=int,
        help="Megatron-LM's (documents between progress lines), accepted for its scripts with one line saying so; "
        "progress here is timed (--progress-seconds)",
    )
    parser.add_argument(
        "--write-metadata",
        nargs="+",
        metavar="PREFIX",
        help="instead of tokenizing: scan existing PREFIX.bin/.idx once and write "
        "PREFIX.meta.json (for data made without this tool)",
    )
    add_tokenizer_arguments(parser)
    return parser


if __name__ == "__main__":  # --help and a bad flag answer before torch and megatron-core load (seconds)
    build_parser().parse_args()

    from megatron_moe.failure import setup_logging  # before megatron-core's imports: its notices filtered

    setup_logging()

import numpy  # noqa: E402
import torch  # noqa: E402
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402

from megatron_moe.config import TOKENIZER_FIELDS, ConfigError, DataConfig, tokenizer_config  # noqa: E402
from megatron_moe.data import DataError, expand_input_paths, iter_sized_documents  # noqa: E402
from megatron_moe.data.datasets import check_prefix_files, check_vocabulary_covers  # noqa: E402
from megatron_moe.data.metadata import (  # noqa: E402
    TokenizerIdentity,
    TokenMetadata,
    metadata_path,
    scan_max_token_id,
    write_metadata,
)
from megatron_moe.data.tokenizer import Tokenizer, build_tokenizer  # noqa: E402


def validate_args(args: argparse.Namespace) -> None:
    """Reject bad numeric arguments with a message naming the flag."""
    if args.workers < 1:
        raise SystemExit(f"--workers {args.workers} must be >= 1 (e.g. --workers 2)")
    if args.log_interval is not None and args.log_interval < 1:
        raise SystemExit(f"--log-interval {args.log_interval} must be >= 1 (e.g. 1000)")
    if not args.progress_seconds >= 0:
        raise SystemExit(f"--progress-seconds {args.progress_seconds} must be >= 0 (e.g. 2; 0: no progress lines)")
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


def encode_document(task: tuple[tuple, bool, dict[str, str], int]) -> tuple[dict[str, numpy.ndarray], int]:
    """Tokenize one document; return ``({key: ids}, input bytes it was read from)`` (the size passes through the
    pool with the result, so progress counts what is tokenized, not what the pool has read ahead)."""
    flags, append_eod, document, num_bytes = task
    tokenizer = _tokenizer(flags)
    encoded = {}
    for key, text in document.items():
        ids = tokenizer.tokenize(text)
        if append_eod:
            ids.append(tokenizer.eod)
        encoded[key] = numpy.asarray(ids, dtype=numpy.int64)
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


def input_bytes(paths: list[str]) -> int | None:
    """The inputs' size in bytes, or None where one is not a regular file (a pipe, a device): then no ETA."""
    try:
        sizes = [os.stat(path) for path in paths]
    except OSError:
        return None
    if not all(os.path.isfile(path) for path in paths):
        return None
    return sum(stat.st_size for stat in sizes)


def _bytes(count: float) -> str:
    """``12.3 MB``: decimal units, as a corpus's size is usually quoted."""
    for unit in ("B", "kB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def _per_second(count: float) -> str:
    """``1,234`` or, under 10, ``2.5``: a slow rate keeps a digit."""
    return f"{count:,.0f}" if count >= 10 else f"{count:.1f}"


def _duration(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``12s``."""
    seconds = round(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class ProgressLog:
    """Progress lines on stderr, whatever the corpus's size: documents and input bytes read, their rates since the
    start and, where the inputs' size is known, the share read and an ETA; at most one line every `interval_s`
    seconds (0: none) and one summary at the end. The clock is read once per document (tens of nanoseconds beside
    tokenizing it)."""

    def __init__(
        self,
        total_bytes: int | None,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        write: Callable[[str], None] | None = None,
    ):
        self.total_bytes = total_bytes
        self.interval_s = interval_s
        self.clock = clock
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.start = clock()
        self.next_line = self.start + interval_s
        self.documents = 0
        self.bytes = 0

    def update(self, num_bytes: int) -> None:
        """Count one document read from `num_bytes` input bytes; print a line if `interval_s` has passed."""
        self.documents += 1
        self.bytes += num_bytes
        if self.interval_s > 0:
            now = self.clock()
            if now >= self.next_line:
                self.write(self.line(now))
                self.next_line = now + self.interval_s

    def line(self, now: float) -> str:
        """``progress: 1,234 documents, 5.6 MB (617 docs/s, 2.8 MB/s); 40.1% of 14.0 MB, ETA 3s``."""
        elapsed = max(now - self.start, 1e-9)
        rate = self.bytes / elapsed
        text = (
            f"progress: {self.documents:,} documents, {_bytes(self.bytes)} "
            f"({_per_second(self.documents / elapsed)} docs/s, {_bytes(rate)}/s)"
        )
        if self.total_bytes:
            share = min(self.bytes / self.total_bytes, 1.0)
            eta = _duration((self.total_bytes - self.bytes) / rate) if rate > 0 else "unknown"
            text += f"; {100 * share:.1f}% of {_bytes(self.total_bytes)}, ETA {eta}"
        return text

    def finish(self) -> None:
        """The summary: ``done: 1,234 documents, 14.0 MB in 5s (247 docs/s, 2.8 MB/s)``."""
        now = self.clock()
        elapsed = max(now - self.start, 1e-9)
        self.write(
            f"done: {self.documents:,} documents, {_bytes(self.bytes)} in {_duration(elapsed)} "
            f"({_per_second(self.documents / elapsed)} docs/s, {_bytes(self.bytes / elapsed)}/s)"
        )


def write_datasets(
    args: argparse.Namespace, data: DataConfig, tokenizer: Tokenizer, paths: list[str]
) -> dict[str, int]:
    """Tokenize all documents into temporary files, sidecars included; return token counts per key."""
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = {}
    for key in args.json_keys:
        with writing(output_paths(args.output_prefix, key)[0]):
            builders[key] = IndexedDatasetBuilder(temporary_path(output_paths(args.output_prefix, key)[0]), dtype=dtype)
    try:
        return fill_datasets(args, data, tokenizer, paths, builders)
    except BaseException:  # closed now: a buffer flushed at exit onto a full disk would print a second error
        for builder in builders.values():
            with contextlib.suppress(OSError):
                builder.data_file.close()
        raise


def fill_datasets(
    args: argparse.Namespace, data: DataConfig, tokenizer: Tokenizer, paths: list[str], builders: dict
) -> dict[str, int]:
    """`write_datasets`' work into its open `builders` (key -> IndexedDatasetBuilder)."""
    dtype = builders[args.json_keys[0]].dtype
    tokens = {key: 0 for key in args.json_keys}
    documents = {key: 0 for key in args.json_keys}
    max_ids = {key: -1 for key in args.json_keys}
    flags = tokenizer_flags(data)
    tasks = ((flags, args.append_eod, doc, size) for doc, size in iter_sized_documents(paths, args.json_keys))
    progress = ProgressLog(input_bytes(paths), args.progress_seconds)
    for encoded, num_bytes in encoded_documents(tasks, args.workers):
        for key, ids in encoded.items():
            if ids.size:
                with writing(output_paths(args.output_prefix, key)[0]):
                    builders[key].add_item(torch.from_numpy(ids))
                    builders[key].end_document()
                tokens[key] += int(ids.size)
                documents[key] += 1
                max_ids[key] = max(max_ids[key], int(ids.max()))
        progress.update(num_bytes)
    empty = [key for key, count in documents.items() if count == 0]
    if empty:
        raise DataError(
            f"--input {' '.join(args.input)}: no documents with tokens for --json-keys {' '.join(empty)} (0 tokens "
            f"from {progress.documents} documents); give .jsonl lines with a non-empty {empty[0]!r} string, or "
            f"non-empty text files"
        )
    identity = TokenizerIdentity.of(tokenizer)
    for key, builder in builders.items():
        with writing(output_paths(args.output_prefix, key)[0]):  # the .bin's last bytes
            builder.data_file.flush()
        with writing(output_paths(args.output_prefix, key)[1]):
            builder.finalize(temporary_path(output_paths(args.output_prefix, key)[1]))
        with writing(sidecar_path(args.output_prefix, key)):
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
    progress.finish()  # every file written: only now "done:"
    return tokens


@contextlib.contextmanager
def writing(path: str, flag: str = "--output-prefix"):
    """An OSError while writing `path` (a full disk, a read-only or unwritable folder) as one DataError naming the
    file (its final name; a temporary one is written) and what to do; the caller removes what was written."""
    try:
        yield
    except OSError as error:
        raise DataError(
            f"{flag}: cannot write {path}: {error.strerror or error}; free space there or give a {flag} "
            f"in a writable folder with room (nothing was written)"
        ) from None


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
    with writing(metadata_path(prefix), "--write-metadata"):
        write_metadata(metadata_path(prefix), metadata)
    print(f"Wrote {metadata_path(prefix)} ({files.num_tokens} tokens, max id {max_id})", file=sys.stderr)
    return metadata


def main(argv: list[str] | None = None) -> dict[str, int]:
    """Run preprocessing; return the number of tokens written per key (per prefix with --write-metadata)."""
    args = build_parser().parse_args(argv)
    validate_args(args)
    if args.log_interval is not None:
        every = args.progress_seconds
        timed = f"progress lines come every {every:g} s (--progress-seconds)" if every else "--progress-seconds 0"
        print(f"--log-interval {args.log_interval}: changes nothing here; {timed}", file=sys.stderr)
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
    with writing(folder):
        os.makedirs(folder, exist_ok=True)
    try:
        tokens = write_datasets(args, data, tokenizer, paths)
        with writing(args.output_prefix):
            publish(args)
    except BaseException:
        remove_temporaries(args)
        if created and not os.listdir(folder):  # nothing left behind, not even the folder
            os.rmdir(folder)
        raise
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
