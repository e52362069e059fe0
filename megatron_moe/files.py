"""Files a reader must never see half written: the checkpoint pointer and manifest, token metadata, the fitted
cost model, a benchmark worker's result.

`write_atomic` writes a temporary file beside the target (this process's own name, so that two writers never
share it), flushes and fsyncs it, and renames it over the target: on a crash the target is the old file or the
new one, never a part, and after the rename the new content is on disk (a pointer published before its data
reached the disk could name a checkpoint that a power loss took).
"""

from __future__ import annotations

import json
import os


def write_atomic(path: str, text: str) -> None:
    """`path` holds `text`, atomically and durably; on an error the temporary file is removed."""
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_json_atomic(path: str, value, **dump_kwargs) -> None:
    """`write_atomic` of `value` as JSON (`json.dumps`' keyword arguments), ending in a newline."""
    write_atomic(path, json.dumps(value, **dump_kwargs) + "\n")
