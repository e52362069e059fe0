"""The metadata sidecar of tokenized data: ``PREFIX.meta.json`` beside ``PREFIX.bin/.idx``.

Start-up reads this small file instead of scanning the ``.bin`` to refuse a tokenizer smaller than the data's
token ids. ``tools/preprocess_data.py`` writes it; other data gets one from one scan
(``python -m tools.preprocess_data --write-metadata PREFIX --tokenizer-model TOKENIZER.model``).
Contents (one JSON object, version 1): format, version, dtype, num_tokens, num_sequences, num_documents,
bin_bytes, max_token_id (-1 when none), tokenizer (vocab_size, model_sha256, pieces_sha256, model_file),
written_by. Invariants: the counts let start-up notice a sidecar that no longer describes its ``.bin/.idx``;
the vocabulary is identified independently of the model file's bytes; the file is written under a temporary
name and renamed into place; this module stays free of torch and megatron-core.
The file's annotated example and why it exists: docs/internals/data.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy

from megatron_moe.data import DataError
from megatron_moe.files import write_json_atomic

FORMAT = "megatron_moe.tokenized_data"
VERSION = 1
SUFFIX = ".meta.json"
WRITE_HINT = "python -m tools.preprocess_data --write-metadata {prefix} --tokenizer-model TOKENIZER.model"
_SCAN_CHUNK = 1 << 24  # tokens per chunk of the one-time scan


def metadata_path(prefix: str) -> str:
    """Where the sidecar of ``prefix`` lives."""
    return prefix + SUFFIX


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerIdentity:
    """What identifies the tokenizer the data was made with."""

    vocab_size: int
    """Number of pieces; token ids are ``0 .. vocab_size - 1``."""
    pieces_sha256: str
    """sha256 of the JSON list of pieces in id order: the vocabulary itself."""
    model_sha256: str
    """sha256 of the tokenizer's files' bytes, one after the other (vocab.json then merges.txt for GPT-2's)."""
    model_file: str
    """The tokenizer's file names, joined by " + " (for messages only)."""

    @property
    def flags(self) -> str:
        """The flags that name the files, for messages: GPT-2's two are --vocab-file and --merge-file."""
        names = self.model_file.split(" + ")
        if len(names) == 2:
            return f"--vocab-file {names[0]} --merge-file {names[1]}"
        return f"--tokenizer-model {self.model_file}"

    @classmethod
    def of(cls, tokenizer) -> TokenizerIdentity:
        """The identity of a tokenizer of ``megatron_moe.data.tokenizer`` (reads its files once). Ids no token
        has (holes in a HuggingFace vocabulary) hash as null."""
        pieces = [tokenizer.inv_vocab.get(i) for i in range(tokenizer.vocab_size)]
        pieces_hash = hashlib.sha256(json.dumps(pieces, ensure_ascii=False).encode("utf-8"))
        return cls(
            vocab_size=tokenizer.vocab_size,
            pieces_sha256=pieces_hash.hexdigest(),
            model_sha256=_files_sha256(tokenizer.files),
            model_file=" + ".join(os.path.basename(path) for path in tokenizer.files),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenMetadata:
    """The contents of ``PREFIX.meta.json`` (see the module docstring)."""

    dtype: str
    num_tokens: int
    num_sequences: int
    num_documents: int
    bin_bytes: int
    max_token_id: int
    tokenizer: TokenizerIdentity
    written_by: str

    def to_json(self) -> dict:
        """The JSON object written to the sidecar."""
        return {"format": FORMAT, "version": VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict, path: str) -> TokenMetadata:
        """Parse a sidecar's JSON object; a DataError names the file and how to rewrite it."""
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise _unusable(path, f"not a {FORMAT} version {VERSION} file")
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(fields - set(data))
        if missing:
            raise _unusable(path, f"missing {', '.join(missing)}")
        values = {name: data[name] for name in fields}
        wrong = [f.name for f in dataclasses.fields(cls) if f.type == "int" and type(values[f.name]) is not int]
        if wrong:
            raise _unusable(path, f"{', '.join(wrong)} not an integer")
        try:
            values["tokenizer"] = TokenizerIdentity(**values["tokenizer"])
        except TypeError as error:
            raise _unusable(path, f"bad tokenizer entry ({error})") from error
        return cls(**values)


def _unusable(path: str, why: str) -> DataError:
    prefix = path[: -len(SUFFIX)] if path.endswith(SUFFIX) else path
    return DataError(
        f"--data-path {prefix}: metadata file {path} is unusable ({why}); "
        f"rewrite it with: {WRITE_HINT.format(prefix=prefix)}"
    )


def _files_sha256(paths: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def read_metadata(prefix: str) -> TokenMetadata | None:
    """The sidecar of ``prefix``, or None when there is none. O(1): the ``.bin`` is not read."""
    path = metadata_path(prefix)
    try:
        with open(path, encoding="utf-8") as stream:
            data = json.load(stream)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise _unusable(path, str(error)) from error
    return TokenMetadata.from_json(data, path)


def write_metadata(path: str, metadata: TokenMetadata) -> None:
    """Write ``metadata`` to ``path`` atomically (a temporary file renamed into place)."""
    write_json_atomic(path, metadata.to_json(), indent=1)


def scan_max_token_id(bin_path: str, dtype: type, num_tokens: int) -> int:
    """Largest token id in a ``.bin`` (-1 when empty): reads all of it, chunk by chunk.

    For ``--write-metadata`` only: this is the scan that start-up must not do.
    """
    if num_tokens == 0:
        return -1
    tokens = numpy.memmap(bin_path, dtype=dtype, mode="r", shape=(num_tokens,))
    try:
        return max(int(tokens[i : i + _SCAN_CHUNK].max()) for i in range(0, num_tokens, _SCAN_CHUNK))
    finally:
        del tokens
