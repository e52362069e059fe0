"""The directories a run writes into or reads from, checked in the flag pass (no torch): `--save` and
`--tensorboard-dir` can be written (or made) by this process, `--load` read. A read-only filesystem or a missing
permission is named by its flag, the path and why, before any process group, instead of a raw OSError on the
save lock's or an event file's path minutes later (docs/troubleshooting.md, "Directories, caches and tools")."""

from __future__ import annotations

import os

WRITTEN = (("--save", "checkpoint", "save"), ("--tensorboard-dir", "logging", "tensorboard_dir"))
"""(flag, config group, field) of each directory the run writes into."""


def why_unwritable(path: str) -> str | None:
    """Why this process cannot write into directory `path` (made where missing, from its nearest existing
    ancestor), or None where it can."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a directory"
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"{existing} is on a read-only filesystem"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user (permission denied)"
    return None


def directory_errors(cfg) -> list[str]:
    """One line per directory flag this run cannot use (the flag, its value, why, what to give)."""
    errors = []
    for flag, group, field in WRITTEN:
        path = getattr(getattr(cfg, group), field)
        if path and (why := why_unwritable(path)):
            errors.append(f"{flag}={path}: cannot write there: {why}; give a writable directory")
    load = cfg.checkpoint.load
    if load and os.path.exists(load) and not os.access(load, os.R_OK | os.X_OK):
        errors.append(f"--load={load}: cannot read it (permission denied); give a directory this user can read")
    return errors
