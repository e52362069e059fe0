"""Every flag an example script passes changes what runs: none is a no-op, none is given twice.

Each example runs with DRY_RUN=1 (as `make check-examples` does, at the world
size the Makefile gives it): it prints its torchrun command and checks its
flags. The trainer's parser names each given flag that would do nothing in that
run in a start-up line (`fields.When`), so an example whose printed flags parse
without such a line passes none.
"""

import collections
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

from megatron_moe.config import parse_args
from tests.conftest import ROOT


def makefile_examples() -> dict[str, tuple[int, int]]:
    """{example: (nodes, processes per node)} from the Makefile's check-examples target."""
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        specs = re.search(r"for spec in ([^;]+);", f.read()).group(1).split()
    return {name: (int(nodes), int(gpus)) for name, nodes, gpus in (spec.split(":") for spec in specs)}


def dry_run(name: str, nodes: int, gpus: int, **overrides: str | None) -> list[str]:
    """The trainer flags the example passes, from its printed torchrun command (`overrides`: environment
    variables set, or removed where None)."""
    command = launch_command(name, nodes, gpus, **overrides)
    return command[command.index(os.path.join(ROOT, "pretrain_gpt_moe.py")) + 1 :]


def launch_command(name: str, nodes: int, gpus: int, *args: str, **overrides: str | None) -> list[str]:
    """The example's printed launch command, words split as the shell would (its flags checked); `args`: extra
    arguments to the script."""
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "DRY_RUN": "1",
        "DATA_PATH": "/data/corpus_text_document",
        "TOKENIZER_MODEL": "/data/tokenizer.model",
        "MASTER_ADDR": "node0",
        "NNODES": str(nodes),
        "GPUS_PER_NODE": str(gpus),
        "PYTHONPATH": ROOT,
    }
    env = {k: v for k, v in {**env, **overrides}.items() if v is not None}
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "examples", f"{name}.sh"), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("flags OK"), proc.stdout
    return shlex.split(proc.stdout.splitlines()[0])


def given_twice(args: list[str]) -> list[str]:
    counts = collections.Counter(a for a in args if a.startswith("--"))
    return sorted(flag for flag, n in counts.items() if n > 1)


def test_every_example_is_checked():
    scripts = {os.path.basename(p)[: -len(".sh")] for p in glob.glob(os.path.join(ROOT, "examples", "*.sh"))}
    assert scripts - {"common"} == set(makefile_examples())


@pytest.mark.parametrize("name", sorted(makefile_examples()))
def test_example_flags_all_change_what_runs(name):
    nodes, gpus = makefile_examples()[name]
    args = dry_run(name, nodes, gpus)
    assert "--num-experts" in args
    assert given_twice(args) == [], f"{name}: flags given twice"
    cfg = parse_args(args)
    cfg.validate(nodes * gpus)
    assert cfg.notes == [], f"{name}: flags that change nothing"


def test_the_checks_can_fail():
    assert given_twice(["--lr", "1", "--seed", "2", "--lr", "3"]) == ["--lr"]
    flags = ["--data-path", "d", "--tokenizer-model", "t", "--num-experts", "8", "--moe-grouped-gemm"]
    (line,) = parse_args(flags).notes  # read only by megatron-core's MoE layer
    assert line.startswith("--moe-grouped-gemm: changes nothing in this run")


def test_the_tiny_cpu_example_trains_on_your_data_or_on_its_own():
    def data(args):
        return args[args.index("--data-path") + 1], args[args.index("--tokenizer-model") + 1]

    yours = dry_run("pretrain_gpt_moe_tiny_cpu", 1, 2)  # DATA_PATH and TOKENIZER_MODEL given, as to the GPU ones
    assert data(yours) == ("/data/corpus_text_document", "/data/tokenizer.model")
    own = dry_run("pretrain_gpt_moe_tiny_cpu", 1, 2, DATA_PATH=None, TOKENIZER_MODEL=None, DATA_DIR="/d")
    assert data(own) == ("/d/stdlib_text_document", "/d/tokenizer.model")


def test_the_examples_take_each_tokenizer_type_from_the_environment():
    """TOKENIZER_MODEL (SentencePiece), VOCAB_FILE + MERGE_FILE (GPT-2's BPE, as Megatron-LM's examples take it),
    or TOKENIZER_TYPE=HuggingFaceTokenizer with TOKENIZER_MODEL: the flags reach the trainer and check out."""

    def tokenizer_flags(args):
        start = args.index("--tokenizer-type")
        return args[start : start + (6 if args[start + 1] == "GPT2BPETokenizer" else 4)]

    gpt2 = {"TOKENIZER_MODEL": None, "VOCAB_FILE": "/d/vocab.json", "MERGE_FILE": "/d/merges.txt"}
    assert tokenizer_flags(dry_run("pretrain_gpt2_s_moe", 1, 8, **gpt2)) == [
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/d/vocab.json", "--merge-file", "/d/merges.txt",
    ]  # fmt: skip
    hf = {"TOKENIZER_TYPE": "HuggingFaceTokenizer", "TOKENIZER_MODEL": "/d/bpe"}
    assert tokenizer_flags(dry_run("pretrain_gpt_moe_tiny_cpu", 1, 2, **hf)) == [
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/d/bpe",
    ]  # fmt: skip
    env = {**os.environ, "PYTHON": sys.executable, "DRY_RUN": "1", "DATA_PATH": "/d/x", "PYTHONPATH": ROOT}
    script = os.path.join(ROOT, "examples", "pretrain_gpt2_s_moe.sh")
    for wrong, message in [
        ({"TOKENIZER_MODEL": "/d/t.model", "VOCAB_FILE": "/d/vocab.json"}, "MERGE_FILE is not set"),
        ({"TOKENIZER_MODEL": "/d/t.model", "VOCAB_FILE": "/d/v", "MERGE_FILE": "/d/m"}, "give one tokenizer"),
        ({"TOKENIZER_TYPE": "GPT2Tokenizer"}, "TOKENIZER_TYPE=GPT2Tokenizer: one of SentencePieceTokenizer, GPT2"),
    ]:
        proc = subprocess.run(["bash", script], env={**env, **wrong}, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def device_connections(command: list[str]) -> str | None:
    """The CUDA_DEVICE_MAX_CONNECTIONS the launch command sets (None: left unset)."""
    assignments = dict(word.split("=", 1) for word in command[: command.index("--nnodes")] if "=" in word)
    return assignments.get("CUDA_DEVICE_MAX_CONNECTIONS")


def test_the_examples_set_one_device_connection_exactly_where_megatron_core_needs_it():
    """TP or CP: megatron-core relies on CUDA_DEVICE_MAX_CONNECTIONS=1 to start the TP collective of the input
    gradient before the weight-gradient GEMM (tensor_parallel/layers.py; Megatron-LM refuses TP or CP without it);
    otherwise it stays unset, leaving the MoE all-to-alls their own hardware queues."""
    for name, (nodes, gpus) in sorted(makefile_examples().items()):
        command = launch_command(name, nodes, gpus)
        parallel = parse_args(command[command.index(os.path.join(ROOT, "pretrain_gpt_moe.py")) + 1 :]).parallel
        needs_one = parallel.tensor_model_parallel_size > 1 or parallel.context_parallel_size > 1
        assert device_connections(command) == ("1" if needs_one else None), name


def test_the_device_connections_follow_the_layout_and_keep_a_value_given():
    assert device_connections(launch_command("pretrain_mixtral_8x7b", 8, 8)) == "1"  # TP=2
    assert device_connections(launch_command("pretrain_gpt2_l_moe", 2, 8)) is None  # TP=1
    assert device_connections(launch_command("pretrain_gpt2_l_moe", 2, 8, TP="2")) == "1"
    extra = ("--tensor-model-parallel-size", "2", "--sequence-parallel")  # given to the script, overriding its TP
    assert device_connections(launch_command("pretrain_gpt2_s_moe", 1, 8, *extra)) == "1"
    given = launch_command("pretrain_mixtral_8x7b", 8, 8, CUDA_DEVICE_MAX_CONNECTIONS="8")
    assert device_connections(given) == "8"
