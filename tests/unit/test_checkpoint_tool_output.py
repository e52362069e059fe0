"""The checkpoint tools' output: HF export files readable as any file this user writes (the umask's mode, not
safetensors' 0600), and megatron-core's notices filtered as training filters them (`MEGATRON_NOISE`)."""

import os
import stat
import subprocess
import sys

import pytest

from megatron_moe.checkpointing.hf_convert import export_hf
from megatron_moe.failure import MEGATRON_NOISE
from tests.conftest import ROOT
from tests.unit.test_hf_mixtral import our_checkpoint  # noqa: F401 (a fixture)


def modes(directory):
    return {name: oct(stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode)) for name in os.listdir(directory)}


@pytest.mark.parametrize("mask, mode", [(0o022, "0o644"), (0o077, "0o600")])
def test_hf_export_files_take_the_umask(our_checkpoint, tmp_path, mask, mode):  # noqa: F811
    old = os.umask(mask)
    try:
        out = export_hf(our_checkpoint, str(tmp_path / "hf"))
    finally:
        os.umask(old)
    found = modes(out)
    assert "model.safetensors" in found and "config.json" in found
    assert set(found.values()) == {mode}, found


def noise(text):
    """megatron-core's `MEGATRON_NOISE` lines (not our own start-up line naming the kernels: "transformer_engine=
    not installed")."""
    lines = [line for line in text.splitlines() if "kernels: transformer_engine=" not in line]
    return [line for line in lines if any(pattern in line for pattern in MEGATRON_NOISE)]


def test_export_hf_prints_no_megatron_core_notices(our_checkpoint, tmp_path):  # noqa: F811
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    command = ["-m", "tools.checkpoint.convert", "export-hf", "--load", our_checkpoint, "--save", str(tmp_path / "hf")]
    proc = subprocess.run([sys.executable, *command], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "export-hf: wrote" in proc.stdout
    output = proc.stdout + proc.stderr
    assert not noise(output) and "warnings.warn" not in output, output[-3000:]


WORKER_LOGS = """
import logging, warnings
from tools.checkpoint.reshard import _setup_worker_logging
_setup_worker_logging()
logging.getLogger("megatron.core.models.gpt").warning("Unknown MLP type: <ModuleSpec>. Using default kwargs.")
logging.getLogger("megatron.core.dist_checkpointing").warning("a real problem")
warnings.warn_explicit("Apex is not installed", UserWarning, "x.py", 1, module="megatron.core.x")
logging.getLogger("megatron_moe").info("reshard: saving iteration 0")
"""


@pytest.mark.parametrize("rank", ["0", "1"])
def test_reshard_workers_filter_megatron_core_notices_as_training_does(rank):
    """The torchrun workers of `convert.py reshard` (tests/distributed/test_reshard.py runs them end to end)."""
    env = dict(os.environ, PYTHONPATH=ROOT, RANK=rank, WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-c", WORKER_LOGS], env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert not noise(proc.stderr), proc.stderr
    assert "a real problem" in proc.stderr
    assert ("reshard: saving iteration 0" in proc.stderr) == (rank == "0"), proc.stderr  # progress: rank 0 only
