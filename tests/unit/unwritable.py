"""Directories a test cannot write into: read-only (a read-only tmpfs mounted over it as root, where permissions
do not stop a write; its mode 0555 otherwise) and full (a tiny tmpfs: ENOSPC at the first larger write). Root
without the right to mount skips the test."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest


def _mount(directory: str, options: str) -> None:
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", directory], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")


@contextlib.contextmanager
def read_only(directory: str):
    """`directory` (made if missing) cannot be written in the block."""
    os.makedirs(directory, exist_ok=True)
    if os.geteuid() != 0:
        os.chmod(directory, 0o555)
        try:
            yield directory
        finally:
            os.chmod(directory, 0o755)
        return
    _mount(directory, "size=64k,ro")
    try:
        yield directory
    finally:
        subprocess.run(["umount", directory], check=True)


@contextlib.contextmanager
def full(directory: str, size: str = "64k"):
    """`directory` (made if missing) is a tmpfs of `size` in the block: a larger write fails with ENOSPC."""
    os.makedirs(directory, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a tmpfs mount (root)")
    _mount(directory, f"size={size}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", directory], check=True)
