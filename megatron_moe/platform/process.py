"""This process's place in torch.distributed before it joins: the single-process default."""

from __future__ import annotations

import os
import socket


def default_to_single_process() -> None:
    """Let `python pretrain_gpt_moe.py ...` (or a tool) run as one rank without torchrun."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
