"""A training run in this process on one rank, on random tokens: the Trainer as pretrain_gpt_moe.py builds it
(megatron-core's DDP model, optimizer and scheduler), without data files or a tokenizer. For the tests that watch
a whole run from inside (`test_host_read_spans.py`, `test_tensorboard_tags.py`); needs the `megatron_world1`
fixture. Vocabulary 128, sequences of 32 tokens, micro-batches of 2."""

from __future__ import annotations

import torch

VOCAB, SEQ, MICRO = 128, 32, 2
SMALL = (
    f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-experts 4 --moe-aux-loss-coeff 0.01 "
    f"--seq-length {SEQ} --micro-batch-size {MICRO} --global-batch-size 4 --log-interval 1 --log-params-norm "
    "--log-num-zeros-in-grad"
).split()
"""The model and batch flags both tests train with; each adds its iteration and validation flags."""


class RandomBatches:
    """The run's data: random tokens, as many as asked for."""

    record = None  # RunData's: no data record to save (random tokens)

    def __init__(self):
        self.train_iterator = self.valid_iterator()

    @staticmethod
    def valid_iterator():
        def batches():
            while True:
                tokens = torch.randint(0, VOCAB, (MICRO, SEQ))
                yield {
                    "tokens": tokens,
                    "labels": tokens,
                    "loss_mask": torch.ones(MICRO, SEQ),
                    "position_ids": torch.arange(SEQ).expand(MICRO, SEQ),
                }

        return batches()


def one_rank_trainer(*flags: str):
    """(config, Trainer) for `SMALL` plus `flags`, validated for a world of one."""
    from megatron_moe.checkpointing import TrainState
    from megatron_moe.config import parse_args
    from megatron_moe.model import transformer_config
    from megatron_moe.training.loop import Trainer
    from megatron_moe.training.setup import build_ddp_model, build_optimizer, build_scheduler, wire_model_config

    cfg = parse_args(["--data-path", "d", "--tokenizer-model", "t", *SMALL, *flags])
    cfg.validate(world_size=1)
    config = transformer_config(cfg)
    model = build_ddp_model(cfg, config, VOCAB)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    wire_model_config(cfg, config, model, optimizer)
    return cfg, Trainer(cfg, model, optimizer, scheduler, TrainState(), RandomBatches())
