"""Pretrain a GPT mixture-of-experts model with megatron-core (launch with torchrun).

    torchrun --nproc-per-node 2 pretrain_gpt_moe.py --num-experts 8 \
        --expert-model-parallel-size 2 --data-path PREFIX --tokenizer-model TOK.model ...

`examples/` has complete launch scripts; `--help` lists every flag by group.

Flag errors come first, all of them in one block from rank 0 ("3 configuration errors:" and one line each),
before any process group, profile or data scan, with exit code 2 and no Python traceback of ours; torchrun
then prints its ChildFailedError summary (its own traceback included: torchrun prints it for any worker that
exits non-zero) with rank 0 as the failure and the configuration errors as its cause; `python -m megatron_moe.launch`
(torchrun's arguments, as the example scripts launch) prints that summary in one line and exits 2.

DRY_RUN=1 (as the example scripts take it; e.g. `DRY_RUN=1 bash your_megatron_lm_script.sh`): the flags and
files are checked and the start-up notes printed, then every rank exits 0 before any process group.

SIGTERM or SIGINT (Ctrl-C; torchrun forwards it to each worker's process group): every rank saves at the next
step (with --save) and exits 0, one line; a second one 3 s or more later exits at once without saving.

Fail fast: an exception on any rank ends that rank at once with "rank R: <message>" and the place it was
raised (the full traceback with MEGATRON_MOE_VERBOSE=1), exit code 1 (2 for a flag, data or tokenizer
error); no collective runs on the way out, and torchrun then stops the other ranks.
"""

import logging
import os
import signal
import sys
import time

if __name__ == "__mp_main__":  # re-imported by a spawned checkpoint-writer process (dist_checkpointing's Manager):
    for _stop in (signal.SIGINT, signal.SIGTERM):  # torchrun's Ctrl-C reaches it too, mid-import; the rank decides
        signal.signal(_stop, signal.SIG_IGN)

from megatron_moe.config import ConfigError, ConfigErrors, layout_line, parse_and_validate
from megatron_moe.config.kernels import probe_kernels
from megatron_moe.data.files import check_data_files
from megatron_moe.failure import exit_now, report_failure, setup_logging, tell_torchrun
from megatron_moe.lifetime import die_with_parent

CONFIG_ERROR_GRACE_S = 5.0
"""How long the other ranks wait on a flag error for rank 0 to print it: torchrun stops every worker at the first
one's exit, which could otherwise be rank 0's before its block is out (its own exit then ends the wait)."""


def main(argv=None) -> int:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: a killed agent (or launcher) takes this worker along
        die_with_parent()
    setup_logging()
    log = logging.getLogger("megatron_moe")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        # Before the heavy imports: --help and flag errors come at once. Before any process group: torchrun's
        # WORLD_SIZE is the world size initialize() will see. The input files are looked for, and the data's
        # documents counted from its .idx header (the splits need some each), not read; the kernels the flags
        # need are looked for without importing torch (the model builder checks them again, the same way).
        cfg = parse_and_validate(argv, world, files=check_data_files, kernels=probe_kernels())
    except ConfigError as error:
        count = len(error.errors) if isinstance(error, ConfigErrors) else 1
        tell_torchrun(f"{count} configuration error{'s' if count > 1 else ''}, listed above by rank 0; no training")
        if rank == 0:  # every rank fails alike; one block says why
            log.error("error: %s", error)
        else:  # torchrun stops the job at the first worker's exit: rank 0's block first, then its exit ends us
            time.sleep(CONFIG_ERROR_GRACE_S)
        return 2
    setup_logging(verbose=cfg.logging.verbose)
    if rank == 0:
        for note in cfg.notes:
            log.info(note)
    if os.environ.get("DRY_RUN", "0") not in ("", "0"):  # as the examples' DRY_RUN=1: checked, nothing started
        if rank == 0:
            log.info("DRY_RUN: flags OK for world size %d: %s; nothing started", world, layout_line(cfg, world))
        return 0
    try:
        run(cfg)  # SIGTERM and SIGINT are stop requests in there: save, then return
    except KeyboardInterrupt:  # during the imports, or with --no-exit-signal-handler
        log.error("rank %d: interrupted (SIGINT): exiting without saving", rank)
        exit_now(128 + signal.SIGINT)
    return 0


def run(cfg) -> None:
    from megatron_moe.data import DataError
    from megatron_moe.data.tokenizer import TokenizerError
    from megatron_moe.training import pretrain

    try:
        pretrain(cfg)
    except Exception as error:  # any rank, any error: end the job now (the other ranks may be mid-collective)
        expected = isinstance(error, (ConfigError, DataError, TokenizerError))
        report_failure(error, expected=expected)
        exit_now(2 if expected else 1)


if __name__ == "__main__":  # the guard matters: the checkpoint writer spawns processes
    sys.exit(main())
