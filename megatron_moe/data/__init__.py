"""Data pipeline: raw text inputs (here), tokenizer, tokenized data, GPT datasets, samplers.

This module stays free of torch and megatron-core so that ``tools/train_tokenizer.py``
starts fast; import ``megatron_moe.data.tokenizer``, ``.datasets`` and ``.sampler``
for the rest.
"""

import glob
import json
import os
from collections.abc import Iterator

JSON_SUFFIXES = (".jsonl", ".json")


class DataError(ValueError):
    """Input text, tokenized data or the arguments that point at them are unusable."""


def expand_input_paths(patterns: list[str], flag: str = "--input") -> list[str]:
    """Expand files, directories (recursively) and globs into a de-duplicated file list.

    Arguments keep their order; each directory or glob expands in sorted order. Hidden
    files and ``__pycache__`` directories are skipped inside directories.
    """
    paths: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            matched = _files_under(pattern)
        elif os.path.isfile(pattern):
            matched = [pattern]
        else:
            matched = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not matched:
            raise DataError(
                f"{flag} {pattern!r}: no such file, or no file under it; "
                f"pass .jsonl files, text files, directories or globs"
            )
        paths.extend(matched)
    return list(dict.fromkeys(paths))


def _files_under(directory: str) -> list[str]:
    """All non-hidden files below ``directory``, sorted, skipping ``__pycache__``."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        found.extend(os.path.join(root, f) for f in files if not f.startswith("."))
    return sorted(found)


def iter_documents(paths: list[str], json_keys: list[str]) -> Iterator[dict[str, str]]:
    """Yield one ``{key: text}`` dict per document.

    ``.jsonl``/``.json`` files hold one JSON object per line; any other file is read whole
    (exactly, line endings kept) as the single key's text.
    """
    for document, _ in iter_sized_documents(paths, json_keys):
        yield document


def iter_sized_documents(paths: list[str], json_keys: list[str]) -> Iterator[tuple[dict[str, str], int]]:
    """`iter_documents` with the input bytes each document was read from (its JSON line, blank lines before it
    included, or its whole file): what a progress report measures against the inputs' size in bytes (the texts'
    own bytes are fewer, a JSON line's keys and escapes left out)."""
    for path in paths:
        if path.endswith(JSON_SUFFIXES):
            yield from _iter_json_lines(path, json_keys)
        else:
            text = _read_text(path)
            yield {_single_key(json_keys, path): text}, len(text.encode("utf-8"))


def _single_key(json_keys: list[str], path: str) -> str:
    """The key a plain-text document is stored under; plain files hold only one text."""
    if len(json_keys) != 1:
        raise DataError(
            f"--json-keys {' '.join(json_keys)}: plain-text input {path!r} holds "
            f"one text per file; pass a single key (e.g. --json-keys text)"
        )
    return json_keys[0]


def _read_text(path: str) -> str:
    """Read a UTF-8 text file exactly (no newline translation)."""
    try:
        with open(path, encoding="utf-8", newline="") as stream:
            return stream.read()
    except UnicodeDecodeError:
        raise not_utf8(path) from None


def _iter_json_lines(path: str, json_keys: list[str]) -> Iterator[tuple[dict[str, str], int]]:
    """Yield the requested keys of each JSON line, with errors naming file and line."""
    try:
        yield from _json_lines(path, json_keys)
    except UnicodeDecodeError:  # the decoder's position is within a read-ahead chunk: find the byte in the file
        raise not_utf8(path) from None


def not_utf8(path: str) -> DataError:
    """The error for a file that is not UTF-8: its first undecodable byte's offset, line and value, and the fix."""
    offset, line, byte, reason = 0, 0, 0, "not UTF-8"
    with open(path, "rb") as stream:
        for number, raw in enumerate(stream, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as error:
                offset, line, byte, reason = offset + error.start, number, raw[error.start], error.reason
                break
            offset += len(raw)
    return DataError(
        f"--input {path}: not UTF-8 text: byte {offset} (line {line}) is 0x{byte:02x} ({reason}); "
        f"re-encode the file to UTF-8 (e.g. iconv -f latin1 -t utf-8 IN > OUT) or leave it out of --input"
    )


def _json_lines(path: str, json_keys: list[str]) -> Iterator[tuple[dict[str, str], int]]:
    skipped = 0  # bytes of blank lines, counted with the next document
    with open(path, encoding="utf-8") as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                skipped += len(line.encode("utf-8"))
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"--input {path}:{number} is not valid JSON ({error})") from error
            missing = [k for k in json_keys if not isinstance(record.get(k), str)]
            if missing:
                raise DataError(
                    f"--json-keys {missing[0]!r}: {path}:{number} has no string "
                    f"field {missing[0]!r}; keys present: {sorted(record)}"
                )
            yield {k: record[k] for k in json_keys}, skipped + len(line.encode("utf-8"))
            skipped = 0
