#!/usr/bin/env python
"""Write a JSON-lines corpus of the Python standard library's own ``.py`` sources.

One ``{"text": SOURCE, "path": RELATIVE_PATH}`` line per file, in sorted path order, from
``sysconfig.get_paths()["stdlib"]``: real text that ships with every Python. Files that
would push the corpus past ``--max-bytes`` are skipped (smaller later files may still
fit), so the output is deterministic for a given Python installation.

Example:
    python -m tools.make_stdlib_corpus --output data/stdlib.jsonl --max-bytes 4000000
"""

import argparse
import json
import os
import sys
import sysconfig
from collections.abc import Iterator

from tools.cli import HelpFormatter

DEFAULT_MAX_BYTES = 4_000_000
DEFAULT_EXCLUDES = [
    "site-packages",  # third-party code, differs between machines
    "dist-packages",
    "test",
    "tests",
    "idle_test",  # test suites: huge, full of deliberately odd code
    "__pycache__",
    "encodings",  # generated codec tables
    "pydoc_data",  # one giant string literal of documentation
]


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--output", required=True, help="the .jsonl file to write")
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help="cap on the total UTF-8 size of the sources (0: no cap)",
    )
    parser.add_argument(
        "--exclude",
        nargs="*",
        default=DEFAULT_EXCLUDES,
        help="directory names to skip wherever they occur (replaces the "
        "default list: " + " ".join(DEFAULT_EXCLUDES) + ")",
    )
    parser.add_argument(
        "--stdlib-dir",
        default=sysconfig.get_paths()["stdlib"],
        help="root to read (default: this Python's standard library)",
    )
    return parser


def iter_sources(root: str, excludes: set[str]) -> Iterator[str]:
    """Yield the ``.py`` files under ``root`` in sorted order, skipping excluded dirs."""
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in excludes and not d.startswith(".")]
        found.extend(os.path.join(directory, f) for f in files if f.endswith(".py"))
    yield from sorted(found, key=lambda p: os.path.relpath(p, root).split(os.sep))


def read_utf8(path: str) -> str | None:
    """The file's text, or None when it is not UTF-8 (a few sources declare other codings)."""
    with open(path, "rb") as stream:
        data = stream.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def write_corpus(output: str, root: str, excludes: set[str], max_bytes: int) -> tuple[int, int]:
    """Write the corpus (via a temporary file); return (files written, bytes of text)."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    temporary = f"{output}.tmp{os.getpid()}"
    count = total = 0
    try:
        with open(temporary, "w", encoding="utf-8") as stream:
            for path in iter_sources(root, excludes):
                text = read_utf8(path)
                size = len(text.encode("utf-8")) if text is not None else 0
                if not text or (max_bytes and total + size > max_bytes):
                    continue
                record = {"text": text, "path": os.path.relpath(path, root)}
                stream.write(json.dumps(record, ensure_ascii=False) + "\n")
                count, total = count + 1, total + size
        os.replace(temporary, output)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return count, total


def main(argv: list[str] | None = None) -> tuple[int, int]:
    """Build the corpus; return (files written, bytes of text)."""
    args = build_parser().parse_args(argv)
    if args.max_bytes < 0:
        raise SystemExit(f"--max-bytes {args.max_bytes} is negative; use 0 (no cap) or e.g. {DEFAULT_MAX_BYTES}")
    if not os.path.isdir(args.stdlib_dir):
        raise SystemExit(f"--stdlib-dir {args.stdlib_dir!r} is not a directory")
    count, total = write_corpus(args.output, args.stdlib_dir, set(args.exclude), args.max_bytes)
    if count == 0:
        raise SystemExit(
            f"--stdlib-dir {args.stdlib_dir}: no .py files left after --exclude "
            f"{' '.join(args.exclude)} and --max-bytes {args.max_bytes}"
        )
    print(f"Wrote {count} files ({total / 1e6:.2f} MB of source) to {args.output}", file=sys.stderr)
    return count, total


if __name__ == "__main__":
    main()
