"""Pretrain a GPT mixture-of-experts model with megatron-core (launch with torchrun).

    torchrun --nproc-per-node 2 pretrain_gpt_moe.py --num-experts 8 \
        --expert-model-parallel-size 2 --data-path PREFIX --tokenizer-model TOK.model ...

`examples/` has complete launch scripts; `--help` lists every flag by group.

Fail fast: an exception on any rank ends that rank at once with "rank R: <message>" and the place it was
raised (the full traceback with MEGATRON_MOE_VERBOSE=1), exit code 1 (2 for a flag, data or tokenizer
error); no collective runs on the way out, and torchrun then stops the other ranks.
"""

import logging
import os
import sys

from megatron_moe.config import ConfigError, parse_args
from megatron_moe.failure import exit_now, report_failure, setup_logging
from megatron_moe.lifetime import die_with_parent


def main(argv=None) -> int:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: a killed agent (or launcher) takes this worker along
        die_with_parent()
    setup_logging()
    log = logging.getLogger("megatron_moe")
    try:
        cfg = parse_args(argv)  # before the heavy imports: --help and flag errors come at once
        # Before any process group: torchrun's WORLD_SIZE is the world size initialize() will see.
        cfg.validate(int(os.environ.get("WORLD_SIZE", 1)))
    except ConfigError as error:
        if int(os.environ.get("RANK", 0)) == 0:  # every rank fails alike; one line says why
            log.error("error: %s", error)
        return 2
    setup_logging(verbose=cfg.logging.verbose)
    if int(os.environ.get("RANK", 0)) == 0:
        for note in cfg.notes:
            log.info(note)
    from megatron_moe.data import DataError
    from megatron_moe.data.tokenizer import TokenizerError
    from megatron_moe.training import pretrain

    try:
        pretrain(cfg)
    except Exception as error:  # any rank, any error: end the job now (the other ranks may be mid-collective)
        expected = isinstance(error, (ConfigError, DataError, TokenizerError))
        report_failure(error, expected=expected)
        exit_now(2 if expected else 1)
    return 0


if __name__ == "__main__":  # the guard matters: the checkpoint writer spawns processes
    sys.exit(main())
