"""Megatron-LM's own MoE launch scripts, kept in examples/megatron_lm/ with only their sizes and paths changed,
run as written: with DRY_RUN=1 each passes the trainer's checks on the world it asks torchrun for, printing one
start-up line per flag it reads otherwise (a tokenizer type read as ours, a flag not needed here, a flag that
changes nothing in this layout); with wrong paths every error comes in one block. The real run of the mock-data
script is tests/distributed/test_megatron_lm_scripts.py."""

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPTS = os.path.join(ROOT, "examples", "megatron_lm")

FAKE_TORCHRUN = """#!{python}
# torchrun for a dry run: the training script once, as rank 0 of the world torchrun would start, with DRY_RUN=1.
import os, sys
args = sys.argv[1:]
options = {{}}
while args[0].startswith("--"):
    name, value = args[0].lstrip("-").replace("_", "-"), args[1]
    options[name], args = value, args[2:]
world = int(options.get("nproc-per-node", 1)) * int(options.get("nnodes", 1))
os.environ.update(RANK="0", WORLD_SIZE=str(world), DRY_RUN="1")
os.execv(sys.executable, [sys.executable, *args])
"""

# The flags each script's start-up lines name, in order: Megatron-LM's flags read as ours or not needed here (as
# they come), then the flags that change nothing in the script's layout (group by group).
READ_AS_OURS = ["--use-mcore-models", "--group-query-attention", "--no-position-embedding", "--tokenizer-type"]
NOTES = {
    "train_mixtral_8x7b_distributed": (2, [*READ_AS_OURS, "--moe-grouped-gemm", "--sequence-parallel"]),
    "moe_readme_mixtral_8x7b": (
        4,
        [*READ_AS_OURS[1:3], "--moe-permute-fusion", "--tokenizer-type", "--moe-grouped-gemm", "--sequence-parallel"],
    ),
    "train_mixtral_8x7b_mock_data": (
        2,
        [
            *READ_AS_OURS,
            "--no-masked-softmax-fusion",
            "--sequence-parallel",
            "--split",
            "--no-load-optim",
            "--no-load-rng",
        ],
    ),
}


@pytest.fixture(scope="module")
def fake_torchrun(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bin")
    path = folder / "torchrun"
    path.write_text(FAKE_TORCHRUN.format(python=sys.executable))
    path.chmod(0o755)
    return str(folder)


@pytest.fixture(scope="module")
def files(tokenizer, line_data, tmp_path_factory):
    """(checkpoint dir, tokenizer model, data prefix): a dry run looks for the files and counts the documents of
    the data (Megatron-LM's --split 99990,8,2 must leave its validation split one); it reads nothing else."""
    return str(tmp_path_factory.mktemp("inputs") / "ckpt"), tokenizer.model_path, line_data[0]


def dry_run(name: str, fake_torchrun: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PATH": f"{fake_torchrun}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": ROOT, **env}
    for launcher_variable in ("RANK", "SLURM_NNODES", "NNODES", "WANDB_API_KEY"):
        full_env.pop(launcher_variable, None)
    script = os.path.join(SCRIPTS, f"{name}.sh")
    return subprocess.run(["bash", script, *args], env=full_env, capture_output=True, text=True, timeout=120)


def start_up_lines(output: str) -> list[str]:
    """The log lines (after their time stamp) the trainer printed."""
    return [match[1] for match in re.finditer(r"^\[[\d: -]+\] (.*)$", output, re.MULTILINE)]


@pytest.mark.parametrize("name", sorted(NOTES))
def test_megatron_lms_script_passes_as_written_with_one_line_per_flag_read_otherwise(name, fake_torchrun, files):
    world, flags = NOTES[name]
    proc = dry_run(name, fake_torchrun, *files, TOKENIZER_MODEL=files[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = start_up_lines(proc.stderr)
    assert "Traceback" not in proc.stderr
    assert lines[-1].startswith(f"DRY_RUN: flags OK for world size {world}: "), lines
    notes = lines[:-1]
    assert [note.split(":")[0].split()[0] for note in notes] == flags, "\n".join(notes)
    assert all(note.endswith(("accepted and ignored", "(same meaning here)")) or "read as" in note for note in notes)
    assert notes.count(next(n for n in notes if n.startswith("--tokenizer-type Llama2Tokenizer: read as"))) == 1


def test_the_scripts_are_megatron_lms_with_only_sizes_and_paths_changed():
    """Each names its source and what was changed; each calls torchrun on our entry point, as theirs on
    pretrain_gpt.py."""
    for name in NOTES:
        with open(os.path.join(SCRIPTS, f"{name}.sh"), encoding="utf-8") as f:
            text = f.read()
        assert "Source: " in text and "NVIDIA/Megatron-LM" in text and "Changed, sizes and paths only:" in text
        assert '"$(dirname "$0")/../../pretrain_gpt_moe.py"' in text and "pretrain_gpt.py \\" not in text


def test_wrong_paths_are_named_together_before_anything_starts(fake_torchrun, tmp_path):
    """Every error in one block from rank 0, exit code 2, no Python traceback: here the three files the script
    names are missing."""
    missing = str(tmp_path / "missing")
    proc = dry_run("train_mixtral_8x7b_distributed", fake_torchrun, missing, f"{missing}.model", missing)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    block = proc.stderr[proc.stderr.index("error: ") :].splitlines()
    assert block[0] == "error: 3 configuration errors:", proc.stderr
    assert block[1:] == [
        f"  --data-path {missing}: missing {missing}.bin; give the prefix tools/preprocess_data.py wrote "
        "(PREFIX_text_document for --output-prefix PREFIX)",
        f"  --data-path {missing}: missing {missing}.idx; give the prefix tools/preprocess_data.py wrote "
        "(PREFIX_text_document for --output-prefix PREFIX)",
        f"  --tokenizer-model={missing}.model: no such file or directory",
    ], proc.stderr


def test_mock_data_is_megatron_cores_mock_dataset_counting_up_to_the_vocabulary(tokenizer):
    """--mock-data: megatron-core's MockGPTDataset, as Megatron-LM builds it (no blend, split 1,1,1): documents
    counting 1, 2, 3, ... modulo the tokenizer's vocabulary, each ended by its eod; a split asked for nothing is
    not built."""
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    from megatron_moe.data.datasets import build_mock_gpt_datasets

    train, valid, test = build_mock_gpt_datasets(
        tokenizer=tokenizer,
        seq_length=64,
        seed=1234,
        train_samples=8,
        valid_samples=4,
        test_samples=0,
        cache_dir=None,
        is_built_on_rank=lambda: True,
    )
    assert isinstance(train, MockGPTDataset) and isinstance(valid, MockGPTDataset) and test is None
    assert len(train) >= 8 and len(valid) >= 4
    vocab, eod, pad = tokenizer.vocab_size, tokenizer.eod, tokenizer.pad
    for sample in (train[0], train[7], valid[0]):
        tokens = sample["tokens"].tolist()
        assert len(tokens) == 64 and max(tokens) < vocab
        # megatron-core's GPTDataset reads the tokenizer's pad id (here a real piece) as padding: 0, loss masked
        counted = [pad if token == 0 and before == pad - 1 else token for before, token in zip([None, *tokens], tokens)]
        for a, b in zip(counted, counted[1:]):
            assert b == eod or (a == eod and b == 1) or b == (a + 1) % vocab, (a, b)


FAMILIES = {
    # Megatron-LM's DeepSeek/Qwen model flags as written (their training: tests/distributed/
    # test_megatron_lm_family_scripts.py): the world each asks torchrun for, and start-up lines each must print.
    "deepseek_v3": (
        2,
        [
            "--moe-token-dispatcher-type flex: read as alltoall in our MoE layer",
            "--moe-flex-dispatcher-backend: not needed here",
            "--transformer-impl transformer_engine: no GPU here, so megatron-core's local modules run",
            "--use-flash-attn: no GPU here",
            "--kv-channels 16: changes nothing in this run",
        ],
    ),
    "deepseek_v2_lite": (2, ["--moe-shared-expert-intermediate-size: read as", "--kv-channels 16: changes nothing"]),
    "qwen3_30b_a3b": (4, ["--group-query-attention: not needed here"]),
    "qwen2_57b_a14b": (4, ["--moe-shared-expert-intermediate-size: read as --moe-shared-expert-ffn-hidden-size 96"]),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_deepseek_and_qwen_scripts_pass_the_first_pass_as_written(name, fake_torchrun, bytelevel_dir, files):
    """Every check that can refuse the run (the kernels included) passes: a script that passes this starts."""
    world, expected = FAMILIES[name]
    proc = dry_run(name, fake_torchrun, files[0], bytelevel_dir, files[2], MEGATRON_MOE_FORCE_CPU="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = start_up_lines(proc.stderr)
    assert lines[-1].startswith(f"DRY_RUN: flags OK for world size {world}: "), lines
    for line in expected:
        assert any(note.startswith(line) for note in lines), (line, lines)
    with open(os.path.join(SCRIPTS, f"{name}.sh"), encoding="utf-8") as f:
        text = f.read()
    assert "NVIDIA/Megatron-LM" in text and "Changed, sizes, degrees and paths only:" in text
