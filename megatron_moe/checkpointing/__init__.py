"""Save and resume with megatron-core dist_checkpointing.

Layout of a `--save` directory:

    latest_checkpointed_iteration.txt   "N", written last (tmp file + rename)
    iter_000000N/                       one dist_checkpointing checkpoint
    iter_000000N.tmp/                   a save in progress (never read)
    iter_000000N.old/                   the previous copy of N while a re-save of N is swapped in

A save writes into `iter_N.tmp`, records every file's sha256 in its
`checksums.json` once every rank has finished, renames it to `iter_N` (an
existing `iter_N` is moved to `iter_N.old` first and deleted only after the
pointer moved), then publishes the pointer: a save killed at any point leaves a
loadable checkpoint that the pointer finds. Without a pointer, `--load` takes the
newest complete `iter_*` (never starts from scratch over them). Loading verifies
the checksums and compares the model's shapes and vocabulary before any tensor. Sharded tensors are resharded by
dist_checkpointing on load, so a checkpoint loads into any TP/PP/EP/ESP layout, with or without virtual
pipeline stages (each chunk's state under "model0", "model1", ... as Megatron-LM stores them; the keys number the
layers globally).
Each rank's RNG states are restored when the layout is the same.

`paths.py` (the pointer, which checkpoint to load), `state.py` (what a checkpoint holds), `save.py`, `load.py`;
`integrity.py` (checksums, disk space), `lock.py` (one job per `--save`), `hf_mixtral.py` / `hf_convert.py`
(HuggingFace Mixtral).
"""

from megatron_moe.checkpointing import integrity
from megatron_moe.checkpointing.load import check_compatible, load_checkpoint, load_model_state
from megatron_moe.checkpointing.paths import TRACKER, check_save_dir, latest_checkpoint, publish, resolve_load_dir
from megatron_moe.checkpointing.save import SAVE_PAUSE_ENV, save_checkpoint
from megatron_moe.checkpointing.state import TrainState

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
