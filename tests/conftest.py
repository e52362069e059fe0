"""Shared fixtures: a small real corpus (this Python's stdlib sources), a tokenizer, data."""

import importlib.util
import json
import os

import pytest

from tests.distributed.launcher import reset_megatron_core_aux_loss_scale
from tests.distributed.shared_jobs import paused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 600
TIERS = ("unit", "distributed", "faults", "slurm")  # folders under tests/, each its own pytest marker (pyproject.toml)


RENDEZVOUS_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def shell_env(**extra: str) -> dict[str, str]:
    """This process's environment for a launch without torchrun, as from a user's shell: without torch.distributed's
    rendezvous variables, which a run in this pytest process may have set (two launches that inherited its
    MASTER_PORT met there: EADDRINUSE)."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}
    return env | extra


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier, the folder it lives in: tests/unit/... -> unit, and so on."""
    for item in items:
        parts = os.path.relpath(str(item.path), ROOT).split(os.sep)
        if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS:
            item.add_marker(parts[1])


@pytest.fixture(scope="module", autouse=True)
def quiet_cores(request):
    """A `quiet_cores` module (`pytestmark`) runs with the background's shared jobs stopped
    (tests/distributed/shared_jobs.py): module-scoped and autouse, so before the module's own fixtures, whose jobs
    are what it times."""
    if request.node.get_closest_marker("quiet_cores") is None:
        yield
        return
    with paused():
        yield


@pytest.fixture(scope="session", autouse=True)
def private_cost_profile_cache(tmp_path_factory):
    """Cost-model profiles the tests' runs cache go to this session's directory, not ~/.cache/megatron_moe: a run
    here never reuses a profile another session (or a person) measured. Torchrun jobs inherit it."""
    os.environ["MEGATRON_MOE_CACHE_DIR"] = str(tmp_path_factory.mktemp("megatron_moe_cache"))


def load_tool(name):
    """Import tools/NAME.py as a module (`tools.NAME`)."""
    return importlib.import_module(f"tools.{name}")


corpus_tool = load_tool("make_stdlib_corpus")
tokenizer_tool = load_tool("train_tokenizer")
preprocess_tool = load_tool("preprocess_data")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """(path of a ~250 KB stdlib jsonl corpus, its documents)."""
    path = str(tmp_path_factory.mktemp("corpus") / "stdlib.jsonl")
    corpus_tool.main(["--output", path, "--max-bytes", "250000"])
    with open(path, encoding="utf-8") as stream:
        documents = [json.loads(line)["text"] for line in stream]
    return path, documents


@pytest.fixture(scope="session")
def tokenizer(corpus, tmp_path_factory):
    """A small BPE tokenizer trained on the corpus."""
    from megatron_moe.data.tokenizer import SentencePieceTokenizer

    prefix = str(tmp_path_factory.mktemp("tok") / "tok")
    model = tokenizer_tool.main(
        ["--input", corpus[0], "--model-prefix", prefix, "--vocab-size", str(VOCAB), "--num-threads", "2"]
    )
    return SentencePieceTokenizer(model)


@pytest.fixture(scope="session")
def train_data(corpus, tokenizer, tmp_path_factory):
    """(data prefix, tokenizer model path) of the preprocessed corpus, for training runs."""
    prefix = str(tmp_path_factory.mktemp("data") / "stdlib")
    preprocess_tool.main(
        ["--input", corpus[0], "--tokenizer-model", tokenizer.model_path, "--output-prefix", prefix, "--append-eod"]
    )
    return prefix + "_text_document", tokenizer.model_path


@pytest.fixture(scope="session")
def line_data(tokenizer, tmp_path_factory):
    """(data prefix, its document count) of the stdlib's non-blank source lines, one document each (~600 KB,
    over 10,000 documents): enough that Megatron-LM's own --split 99990,8,2 leaves its validation split one."""
    folder = tmp_path_factory.mktemp("lines")
    files = str(folder / "stdlib.jsonl")
    corpus_tool.main(["--output", files, "--max-bytes", "600000"])
    lines = str(folder / "lines.jsonl")
    count = 0
    with open(files, encoding="utf-8") as source, open(lines, "w", encoding="utf-8") as sink:
        for record in source:
            for line in json.loads(record)["text"].splitlines():
                if line.strip():
                    sink.write(json.dumps({"text": line}) + "\n")
                    count += 1
    prefix = str(folder / "lines")
    preprocess_tool.main(
        ["--input", lines, "--tokenizer-model", tokenizer.model_path, "--output-prefix", prefix, "--append-eod"]
    )
    return prefix + "_text_document", count


@pytest.fixture(scope="session")
def example_data(train_data, tmp_path_factory):
    """A $DATA_DIR as the tiny example (examples/pretrain_gpt_moe_tiny_cpu.sh) reads it: the session's tokenized
    corpus and tokenizer, linked under the example's names."""
    prefix, tokenizer = train_data
    directory = tmp_path_factory.mktemp("example_data")
    for suffix in (".bin", ".idx", ".meta.json"):
        os.symlink(prefix + suffix, directory / f"stdlib_text_document{suffix}")
    os.symlink(tokenizer, directory / "tokenizer.model")
    return str(directory)


@pytest.fixture(scope="session")
def bytelevel_dir(corpus, tmp_path_factory):
    """A GPT-2 byte-level BPE trained on the corpus: vocab.json, merges.txt, tokenizer.json, tokenizer_config.json."""
    directory = str(tmp_path_factory.mktemp("bytelevel") / "bpe")
    return tokenizer_tool.main(
        ["--input", corpus[0], "--model-type", "bytelevel-bpe", "--model-prefix", directory, "--vocab-size", str(VOCAB)]
    )


@pytest.fixture(scope="session")
def tokenizer_flags(tokenizer, bytelevel_dir):
    """{--tokenizer-type: the flags that build it}: the session's sentencepiece model, and the byte-level BPE as
    GPT2BPETokenizer (its vocab.json and merges.txt) and as HuggingFaceTokenizer (its directory)."""
    return {
        "SentencePieceTokenizer": [
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            tokenizer.model_path,
        ],
        "GPT2BPETokenizer": [
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            os.path.join(bytelevel_dir, "vocab.json"),
            "--merge-file",
            os.path.join(bytelevel_dir, "merges.txt"),
        ],
        "HuggingFaceTokenizer": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bytelevel_dir],
    }


@pytest.fixture(scope="session")
def tokenizer_train_data(corpus, train_data, tokenizer_flags, tmp_path_factory):
    """{--tokenizer-type: ["--data-path", PREFIX, *its tokenizer flags]}: the same corpus through each tokenizer."""
    runs = {"SentencePieceTokenizer": ["--data-path", train_data[0], *tokenizer_flags["SentencePieceTokenizer"]]}
    for kind in ("GPT2BPETokenizer", "HuggingFaceTokenizer"):
        prefix = str(tmp_path_factory.mktemp("data") / kind)
        preprocess_tool.main(["--input", corpus[0], *tokenizer_flags[kind], "--output-prefix", prefix, "--append-eod"])
        runs[kind] = ["--data-path", prefix + "_text_document", *tokenizer_flags[kind]]
    return runs


@pytest.fixture(scope="module")
def megatron_world1():
    """torch.distributed (gloo, one rank) and megatron-core's parallel state, for in-process models."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_moe.platform.process import init_single_process

    init_single_process(seed=0, backend="gloo")
    reset_megatron_core_aux_loss_scale()
    yield
    reset_megatron_core_aux_loss_scale()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
