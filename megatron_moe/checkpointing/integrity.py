"""What makes a checkpoint directory trustworthy: completeness, per-file checksums, shapes, disk space.

Every check here reads the filesystem only (no collective), so each rank can
make it alone and an error on one rank cannot leave another waiting.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil

from megatron_moe.config import ConfigError
from megatron_moe.files import write_json_atomic

MANIFEST = "checksums.json"  # written last into iter_N.tmp, before it is renamed to iter_N
_ITER_DIR = re.compile(r"iter_(\d+)$")  # published ones only: not iter_N.tmp / iter_N.old
_CHUNK = 8 << 20
# A save that failed with less than this free where it writes (or less than the checkpoint's size): a full disk,
# whatever the error says (torch.save reports ENOSPC as "unexpected pos").
NEARLY_FULL = 1 << 20


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or trusted: reported in one line, like a bad flag."""


def is_complete(path: str) -> bool:
    """dist_checkpointing's metadata is present: its save finished (the manifest, when any, is checked on load)."""
    return os.path.isfile(os.path.join(path, "metadata.json"))


def newest_complete(root: str) -> tuple[str | None, list[str]]:
    """The newest complete published `iter_*` under `root`, and every published `iter_*` found."""
    found = sorted((int(m.group(1)), name) for name in os.listdir(root) if (m := _ITER_DIR.match(name)) is not None)
    names = [name for _, name in found]
    for _, name in reversed(found):
        if is_complete(os.path.join(root, name)):
            return os.path.join(root, name), names
    return None, names


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(path: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(parent, name), path)
        for parent, _, names in os.walk(path)
        for name in names
        if name != MANIFEST
    )


def write_manifest(path: str) -> None:
    """Record size and sha256 of every file of the checkpoint at `path` (all writers have finished)."""
    files = {}
    for name in _files(path):
        file = os.path.join(path, name)
        files[name] = {"bytes": os.path.getsize(file), "sha256": sha256(file)}
    write_json_atomic(os.path.join(path, MANIFEST), {"files": files}, indent=1)


def verify_manifest(path: str) -> bool:
    """Check every file the manifest lists; False when the checkpoint has none (saved before checksums)."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        return False
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
        files = {name: (int(want["bytes"]), str(want["sha256"])) for name, want in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:  # truncated, or not a manifest
        raise CheckpointError(
            f"--load={path}: its {MANIFEST} is unreadable ({type(error).__name__}: {error}), so its files cannot be "
            f"verified; restore it from a copy, or delete {manifest} to load the checkpoint unverified"
        ) from None
    for name, (size_saved, sha_saved) in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"--load={path}: {name} is missing (the checkpoint lists it in {MANIFEST})")
        size = os.path.getsize(file)
        if size != size_saved:
            raise CheckpointError(f"--load={path}: {name} holds {size} bytes, {size_saved} were saved (truncated?)")
        if sha256(file) != sha_saved:
            raise CheckpointError(f"--load={path}: {name} is corrupt: its sha256 differs from the one saved")
    return True


def check_tensor_shapes(path: str, wanted: dict[str, tuple[int, ...]], stored: dict) -> None:
    """Refuse tensors whose global shape in the checkpoint differs from this model's (e.g. another vocabulary)."""
    diffs = [
        f"{key}: checkpoint {list(stored[key].global_shape)}, now {list(shape)}"
        for key, shape in sorted(wanted.items())
        if key in stored and tuple(stored[key].global_shape) != tuple(shape)
    ]
    if diffs:
        raise CheckpointError(
            f"--load={path}: {len(diffs)} tensor shape(s) differ: {'; '.join(diffs[:3])}"
            f"{' ...' if len(diffs) > 3 else ''}; load it with the model flags and tokenizer it was saved with"
        )


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(parent, n)) for parent, _, names in os.walk(path) for n in names)


def free_bytes(root: str) -> int:
    return shutil.disk_usage(root).free if os.path.isdir(root) else 0


def _wrapped(err: BaseException) -> list[BaseException]:
    """What `err` wraps: its cause and context, and torch.distributed.checkpoint's CheckpointException's failures
    ({rank: (exception, stack summary)}, gathered from every rank)."""
    inner = [err.__cause__, err.__context__]
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            inner.append(failure[0] if isinstance(failure, tuple) and failure else failure)
    return [e for e in inner if isinstance(e, BaseException)]


def is_disk_full(error: BaseException) -> bool:
    """True when `error`, or an error it wraps (dist_checkpointing re-raises the writers'), is ENOSPC. Its text
    counts too: an error pickled from a writer process or another rank has lost its cause."""
    seen = set()
    pending = [error]
    while pending:
        err = pending.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        if f"[Errno {errno.ENOSPC}]" in str(err) or os.strerror(errno.ENOSPC) in str(err):
            return True
        pending += _wrapped(err)
    return False


def describe(error: BaseException) -> str:
    """One line for a failed save: the innermost cause, on the first failing rank (torch's CheckpointException
    prints every rank's traceback)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        if not failures:  # what every rank but dist_checkpointing's coordinator gets
            return "on another rank (rank 0 names it)"
        rank, (first, _) = next(iter(failures.items()))
        return f"rank {rank}: {describe(first)}"
    if error.__cause__ is not None:
        return describe(error.__cause__)
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def disk_full_error(root: str, tmp: str, needed: int, free: int) -> CheckpointError:
    return CheckpointError(
        f"--save={root}: disk full while writing {os.path.basename(tmp)}: about {needed} bytes needed, "
        f"{free} free; the previous checkpoint is intact. Free space or point --save elsewhere"
    )
