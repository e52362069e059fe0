"""What identifies the contents of a tokenized data prefix, cheaply: `PrefixFingerprint` (the sizes of
``PREFIX.bin/.idx``, the document count, a sha256 of the whole ``.idx`` and of `SAMPLE_BLOCKS` blocks of the
``.bin``, spread evenly over it: O(.idx) + 64 KiB, never the whole ``.bin``), and a run's data record
(`data_record`: its ``--data-path`` and each prefix's fingerprint), saved in checkpoints and compared on resume
(`data_changes`).
Uses: megatron-core's index cache is keyed by it (datasets.py `GPTDataset`), so a prefix rebuilt in place never
reads the indices made for its old contents; a resume on other data is refused (checkpointing/load.py).
Limits: a change inside the ``.bin`` that keeps every sequence's length and misses the sampled blocks goes
unseen (the ``.idx`` hash sees any change of lengths). This module stays free of torch and megatron-core.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os

from megatron_moe.data.files import read_idx_header

SAMPLE_BLOCKS = 16
BLOCK_BYTES = 4096
"""One page each, page-aligned: the ``.bin``'s pages a fingerprint reads are at most `SAMPLE_BLOCKS`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefixFingerprint:
    """The contents of ``PREFIX.bin/.idx``, as far as a run's identity needs them."""

    bin_bytes: int
    idx_bytes: int
    num_documents: int
    idx_sha256: str
    bin_samples_sha256: str
    """sha256 of `SAMPLE_BLOCKS` blocks of the ``.bin`` (all of it when it is smaller)."""

    @property
    def digest(self) -> str:
        """A short key of all the above (the index cache's and the token-id scan's)."""
        text = "|".join(str(value) for value in dataclasses.astuple(self))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def changes_from(self, old: PrefixFingerprint) -> list[str]:
        """What differs from `old`, in words: sizes, documents, else the contents."""
        changed = [
            f"{what} {getattr(old, name)} -> {getattr(self, name)}"
            for what, name in ((".bin bytes", "bin_bytes"), (".idx bytes", "idx_bytes"), ("documents", "num_documents"))
            if getattr(old, name) != getattr(self, name)
        ]
        if not changed and self != old:
            which = [f for f in (".idx", ".bin") if getattr(self, _HASHES[f]) != getattr(old, _HASHES[f])]
            changed.append(f"same sizes, other contents ({' and '.join(which)})")
        return changed


_HASHES = {".idx": "idx_sha256", ".bin": "bin_samples_sha256"}


def fingerprint_prefix(prefix: str) -> PrefixFingerprint:
    """The fingerprint of ``prefix`` (its files must exist; the ``.idx`` header is checked). Hashed once per
    process while its files stay the same (inode, size, mtime): a start-up asks three times (the run's record,
    the token-id scan's cache, megatron-core's index cache key)."""
    files = tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in map(os.stat, (prefix + ".idx", prefix + ".bin")))
    return _fingerprint(prefix, files)


@functools.lru_cache(maxsize=64)
def _fingerprint(prefix: str, files: tuple) -> PrefixFingerprint:
    del files  # the cache key only: other files, another hash
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    num_documents = read_idx_header(idx_path)[2] - 1  # boundaries: documents + 1
    idx_hash = hashlib.sha256()
    with open(idx_path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            idx_hash.update(block)
    return PrefixFingerprint(
        bin_bytes=os.path.getsize(bin_path),
        idx_bytes=os.path.getsize(idx_path),
        num_documents=num_documents,
        idx_sha256=idx_hash.hexdigest(),
        bin_samples_sha256=_sampled_sha256(bin_path),
    )


def _sampled_sha256(path: str) -> str:
    """sha256 of `SAMPLE_BLOCKS` page-aligned blocks from the first to the last, read without read-ahead."""
    size = os.path.getsize(path)
    last = max(size - 1, 0) // BLOCK_BYTES
    starts = sorted({i * last // (SAMPLE_BLOCKS - 1) * BLOCK_BYTES for i in range(SAMPLE_BLOCKS)})
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):  # else the kernel reads ahead of each block
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for start in starts:
            digest.update(os.pread(fd, BLOCK_BYTES, start))
    finally:
        os.close(fd)
    return digest.hexdigest()


def _blend(data_path: list[str]) -> tuple[list[str], list[str]]:
    """(weights, prefixes) of --data-path: one prefix alone weighs 1."""
    return (list(data_path[0::2]), list(data_path[1::2])) if len(data_path) > 1 else (["1"] * len(data_path), data_path)


def data_record(data_path: list[str], mock_data: bool) -> dict:
    """A run's data as a checkpoint records it: --data-path as given and each prefix's fingerprint (JSON)."""
    prefixes = _blend(data_path)[1]
    return {
        "mock_data": mock_data,
        "data_path": list(data_path),
        "fingerprints": [dataclasses.asdict(fingerprint_prefix(p)) for p in prefixes] if not mock_data else [],
    }


def data_changes(saved: dict, now: dict) -> list[str]:
    """How `now`'s data differs from `saved`'s (`data_record`s), one entry per difference; [] when the same.
    Prefixes pair by position in the blend: the same contents at another path are the same data."""

    def described(record):
        return "--mock-data" if record["mock_data"] else "--data-path " + " ".join(record["data_path"])

    if saved["mock_data"] != now["mock_data"] or len(saved["fingerprints"]) != len(now["fingerprints"]):
        return [f"the checkpoint was trained on {described(saved)}, this run reads {described(now)}"]
    changes = []
    (saved_weights, saved_prefixes), (weights, prefixes) = _blend(saved["data_path"]), _blend(now["data_path"])
    if [float(w) for w in saved_weights] != [float(w) for w in weights]:
        changes.append(f"blend weights {' '.join(saved_weights)} -> {' '.join(weights)}")
    for old_prefix, prefix, old, new in zip(saved_prefixes, prefixes, saved["fingerprints"], now["fingerprints"]):
        old, new = PrefixFingerprint(**old), PrefixFingerprint(**new)
        if old != new:
            moved = f" (the checkpoint's: {old_prefix})" if old_prefix != prefix else ""
            changes.append(f"--data-path {prefix}{moved}: {', '.join(new.changes_from(old))}")
    return changes
