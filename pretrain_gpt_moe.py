"""Pretrain a GPT mixture-of-experts model with megatron-core (launch with torchrun).

    torchrun --nproc-per-node 2 pretrain_gpt_moe.py --num-experts 8 \
        --expert-model-parallel-size 2 --data-path PREFIX --tokenizer-model TOK.model ...

`examples/` has complete launch scripts; `--help` lists every flag by group.
"""

import logging
import os
import sys
import warnings

from megatron_moe.config import ConfigError, parse_args


def setup_logging() -> None:
    """Our INFO lines on rank 0 and the last rank (which holds the loss); megatron-core's at WARNING."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    level = logging.INFO if rank in (0, world - 1) else logging.WARNING
    logging.basicConfig(level=level, format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    # We subclass its legacy tokenizer on purpose (the GPTDataset interface); no need to say so per run.
    logging.getLogger("megatron.core.datasets.megatron_tokenizer").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="megatron")  # apex/TE-absent notices, deprecations
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def main(argv=None) -> int:
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
    from megatron_moe.data import DataError
    from megatron_moe.data.tokenizer import TokenizerError
    from megatron_moe.training import pretrain

    try:
        pretrain(cfg)
    except (ConfigError, DataError, TokenizerError) as error:
        log.error("error: %s", error)
        return 2
    return 0


if __name__ == "__main__":  # the guard matters: the checkpoint writer spawns processes
    sys.exit(main())
