"""Save and resume with megatron-core dist_checkpointing.

A `--save` directory holds `latest_checkpointed_iteration.txt` (the pointer, "N", published last and atomically),
`iter_000000N/` (one dist_checkpointing checkpoint), `iter_000000N.tmp/` (a save in progress, never read) and
`iter_000000N.old/` (the previous copy of N while a re-save of N is swapped in).
Invariants: a save killed at any point leaves a loadable checkpoint that the pointer (or, without one, the newest
complete `iter_*`) finds; loading verifies checksums, shapes and vocabulary before any tensor; a checkpoint loads
into any TP/PP/EP/ESP/VPP layout; RNG states are restored only in the same layout.
The save sequence and the per-chunk keys: docs/internals/checkpointing.md.

`paths.py` (the pointer, which checkpoint to load), `state.py` (what a checkpoint holds), `save.py`, `load.py`;
`integrity.py` (checksums, disk space), `lock.py` (one job per `--save`), `hf_families.py` / `hf_tensors.py` /
`hf_convert.py` (HuggingFace Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3). Loaded on first use (PEP 562):
`hf_families` imports without torch and megatron-core (`import-hf` refuses a bad config.json before they load).
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_moe.checkpointing import integrity
    from megatron_moe.checkpointing.load import check_compatible, load_checkpoint, load_model_state
    from megatron_moe.checkpointing.paths import TRACKER, check_save_dir, latest_checkpoint, publish, resolve_load_dir
    from megatron_moe.checkpointing.save import SAVE_PAUSE_ENV, save_checkpoint
    from megatron_moe.checkpointing.state import TrainState

_LAZY = {
    "check_compatible": "load",
    "load_checkpoint": "load",
    "load_model_state": "load",
    "TRACKER": "paths",
    "check_save_dir": "paths",
    "latest_checkpoint": "paths",
    "publish": "paths",
    "resolve_load_dir": "paths",
    "SAVE_PAUSE_ENV": "save",
    "save_checkpoint": "save",
    "TrainState": "state",
}


def __getattr__(name: str):
    if name == "integrity":
        return importlib.import_module("megatron_moe.checkpointing.integrity")
    if name in _LAZY:
        return getattr(importlib.import_module(f"megatron_moe.checkpointing.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SAVE_PAUSE_ENV",
    "TRACKER",
    "TrainState",
    "check_compatible",
    "check_save_dir",
    "integrity",
    "latest_checkpoint",
    "load_checkpoint",
    "load_model_state",
    "publish",
    "resolve_load_dir",
    "save_checkpoint",
]
