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


def umask() -> int:
    """The process's umask (read by setting it and setting it back: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_usual_permissions(directory: str) -> None:
    """Each file under `directory` gets the mode a plain `open(path, "w")` would give it (0644 under umask 022):
    some writers create theirs 0600 (safetensors' `save_file`), which would keep a shared model from its readers."""
    mode = 0o666 & ~umask()
    for folder, _, names in os.walk(directory):
        for name in names:
            os.chmod(os.path.join(folder, name), mode)
