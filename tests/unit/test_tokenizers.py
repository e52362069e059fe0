"""The three --tokenizer-type choices on the same real corpus (the stdlib sources): ids round-trip, eod/pad, the
flags' errors, tools/preprocess_data.py and tools/train_tokenizer.py with each, and the start-up summary."""

import json
import logging
import os
import pickle
import shutil

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer as NativeTokenizer
from tokenizers import models, pre_tokenizers, trainers

from megatron_moe.config import ConfigError, parse_args
from megatron_moe.data import DataError
from megatron_moe.data.datasets import validate_data_prefix
from megatron_moe.data.metadata import TokenizerIdentity, read_metadata
from megatron_moe.data.tokenizer import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    build_tokenizer,
)
from tests.conftest import VOCAB, preprocess_tool, tokenizer_tool

TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer")
TRICKY = [
    "",
    "\n\n\tx = 1  \r\n",
    "    def f(a,  b):\n\t\treturn a ** 2  # caf\u00e9 \u2603 \U0001f600\n",
    "\x00\x7f" + " " * 40 + "\u00a0end",
]


def build(flags: list[str]):
    """The tokenizer training builds from these flags."""
    return build_tokenizer(parse_args(["--data-path", "x", *flags]).data)


@pytest.fixture(scope="module")
def tokenizers(tokenizer_flags):
    return {kind: build(flags) for kind, flags in tokenizer_flags.items()}


@pytest.mark.parametrize("kind", TYPES)
def test_each_tokenizer_round_trips_the_corpus_exactly(corpus, tokenizers, kind):
    tokenizer = tokenizers[kind]
    assert tokenizer.tokenizer_type == kind
    for text in corpus[1] + TRICKY:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    ids = tokenizer.tokenize(corpus[1][0])
    assert len(ids) < 0.7 * len(corpus[1][0])  # real merges, not bytes
    assert max(max(tokenizer.tokenize(text)) for text in corpus[1]) < tokenizer.vocab_size == VOCAB
    again = pickle.loads(pickle.dumps(tokenizer))  # data loader and preprocessing workers rebuild it from its files
    assert again.tokenize(corpus[1][0]) == ids and again.files == tokenizer.files


@pytest.mark.parametrize(
    "kind, eod_token, pad",
    [
        ("SentencePieceTokenizer", "</s>", 3),
        ("GPT2BPETokenizer", "<|endoftext|>", -1),
        ("HuggingFaceTokenizer", "<|endoftext|>", -1),
    ],
)
def test_eod_and_pad(tokenizers, kind, eod_token, pad):
    """eod = eos, a real token; pad differs from both (megatron-core masks pad and checks the collision)."""
    tokenizer = tokenizers[kind]
    assert tokenizer.inv_vocab[tokenizer.eod] == eod_token and tokenizer.vocab[eod_token] == tokenizer.eod
    assert tokenizer.eos == tokenizer.eod and tokenizer.pad == pad != tokenizer.eod


def test_gpt2_bpe_is_gpt2s_as_transformers_runs_it(corpus, tokenizers, bytelevel_dir, tmp_path):
    """Megatron-LM's GPT-2 semantics: the ids of transformers' GPT-2 tokenizer over the same vocab.json and
    merges.txt; a literal <|endoftext|> is text to GPT2BPETokenizer (as to Megatron-LM's), the special token to a
    HuggingFace tokenizer.json that registers it (as to transformers)."""
    transformers = pytest.importorskip("transformers")
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(os.path.join(bytelevel_dir, name), tmp_path / name)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    gpt2, hf = tokenizers["GPT2BPETokenizer"], tokenizers["HuggingFaceTokenizer"]
    for text in corpus[1] + TRICKY:
        assert gpt2.tokenize(text) == hf.tokenize(text) == reference.encode(text, add_special_tokens=False)
    literal = "a <|endoftext|> b"
    assert gpt2.eod not in gpt2.tokenize(literal) and hf.eod in hf.tokenize(literal)
    assert gpt2.detokenize([*gpt2.tokenize("x"), gpt2.eod]) == "x<|endoftext|>"


def test_the_tokenizer_json_path_and_its_directory_are_one_tokenizer(tokenizers, bytelevel_dir):
    by_file = HuggingFaceTokenizer(os.path.join(bytelevel_dir, "tokenizer.json"))
    by_dir = tokenizers["HuggingFaceTokenizer"]
    assert by_file.files == by_dir.files == (os.path.join(bytelevel_dir, "tokenizer.json"),)
    assert by_file.tokenize("import os\n") == by_dir.tokenize("import os\n")


def small_native_tokenizer(corpus, special_tokens: list[str]) -> NativeTokenizer:
    native = NativeTokenizer(models.BPE())
    native.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    native.train_from_iterator(corpus[1][:2], trainer=trainer)
    return native


def test_hf_special_tokens_from_the_vocabulary_and_tokenizer_config(corpus, tmp_path):
    native = small_native_tokenizer(corpus, ["<s>", "</s>", "<pad>"])
    native.save(str(tmp_path / "tokenizer.json"))
    alone = HuggingFaceTokenizer(str(tmp_path))  # no tokenizer_config.json: the usual names
    assert (alone.bos, alone.eod, alone.pad) == (0, 1, 2)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<s>"}, "pad_token": "<s>"}))
    configured = HuggingFaceTokenizer(str(tmp_path))
    assert configured.eod == 0 and configured.pad == -1  # a pad equal to the eod: megatron-core's sentinel


def test_hf_tokenizer_without_an_eod_names_flag_path_and_what_is_expected(corpus, tmp_path):
    path = str(tmp_path / "tokenizer.json")
    small_native_tokenizer(corpus, []).save(path)
    with pytest.raises(TokenizerError) as error:
        HuggingFaceTokenizer(path)
    message = str(error.value)
    assert message.startswith(f"--tokenizer-model {path!r} defines no end-of-document token")
    assert "eos_token" in message and "<|endoftext|>, </s>" in message


def test_gpt2_file_errors_name_the_flag_the_path_and_the_fix(bytelevel_dir, tmp_path):
    vocab, merges = os.path.join(bytelevel_dir, "vocab.json"), os.path.join(bytelevel_dir, "merges.txt")
    missing = str(tmp_path / "nope.json")
    cases = [
        ((missing, merges), f"--vocab-file {missing!r}: no such file; pass GPT-2's vocab.json"),
        ((merges, merges), f"--vocab-file {merges!r} is not JSON"),
        (
            (os.path.join(bytelevel_dir, "tokenizer.json"), merges),
            "does not map tokens to ids; a tokenizer.json goes with --tokenizer-type HuggingFaceTokenizer",
        ),
        ((vocab, vocab), f'--merge-file {vocab!r} line 1 is \'{{"<|endoftext|>":0,'),
        ((vocab, str(tmp_path)), f"--merge-file {str(tmp_path)!r} is a directory; pass GPT-2's merges.txt"),
    ]
    for (vocab_file, merge_file), message in cases:
        with pytest.raises(TokenizerError) as error:
            GPT2BPETokenizer(vocab_file, merge_file)
        assert message in str(error.value), str(error.value)
    no_eod = tmp_path / "vocab.json"
    no_eod.write_text(json.dumps({k: v for k, v in json.load(open(vocab)).items() if k != "<|endoftext|>"}))
    with pytest.raises(TokenizerError, match=r"has no <\|endoftext\|> token, GPT-2's end of document"):
        GPT2BPETokenizer(str(no_eod), merges)


def test_tokenizer_model_of_the_wrong_kind_names_the_type_to_use(tokenizer, bytelevel_dir, tmp_path):
    with pytest.raises(TokenizerError, match="looks like a SentencePiece model: pass --tokenizer-type Sentence"):
        HuggingFaceTokenizer(tokenizer.model_path)
    gpt2_only = tmp_path / "gpt2"
    gpt2_only.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(os.path.join(bytelevel_dir, name), gpt2_only / name)
    with pytest.raises(TokenizerError, match="holds no tokenizer.json; its vocab.json and merges.txt go with --token"):
        HuggingFaceTokenizer(str(gpt2_only))
    with pytest.raises(TokenizerError, match="no such file or directory; pass a directory holding tokenizer.json"):
        HuggingFaceTokenizer(str(tmp_path / "missing"))
    with pytest.raises(TokenizerError, match="is not a SentencePiece .model; for a HuggingFace tokenizer.json"):
        SentencePieceTokenizer(bytelevel_dir)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--vocab-file", "v.json"], "--vocab-file v.json: changes nothing in this run (it applies only with "),
        (
            [
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--tokenizer-model",
                "t",
                "--vocab-file",
                "v",
                "--merge-file",
                "m",
            ],
            "--tokenizer-model t: changes nothing in this run (it applies only with --tokenizer-type SentencePiece",
        ),
    ],
)
def test_a_tokenizer_flag_that_does_nothing_is_accepted_with_one_line(flags, message):
    (line,) = parse_args(["--data-path", "d", *flags]).notes
    assert line.startswith(message)


def test_a_tokenizer_type_that_does_not_exist_is_refused():
    with pytest.raises(ConfigError) as error:
        parse_args(["--data-path", "d", "--tokenizer-type", "GPT2Tokenizer"])
    assert "argument --tokenizer-type: invalid choice: 'GPT2Tokenizer'" in str(error.value)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v"], "--merge-file=None: --tokenizer-type "),
        (["--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file=None: --tokenizer-type GPT2BPETokenizer needs GPT"),
        (["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-model=None: --tokenizer-type HuggingFaceTok"),
    ],
)
def test_a_missing_tokenizer_file_flag_is_named(flags, message):
    with pytest.raises(ConfigError) as error:
        parse_args(["--data-path", "d", *flags]).validate(1)
    assert message in str(error.value)


# ------------------------------------------------------------------- preprocessing, training the tokenizer


@pytest.mark.parametrize("kind", TYPES)
def test_preprocess_with_each_tokenizer_reads_back_exactly(corpus, tokenizers, tokenizer_train_data, kind):
    tokenizer = tokenizers[kind]
    prefix = tokenizer_train_data[kind][1]
    dataset = IndexedDataset(prefix)
    assert len(dataset) == len(corpus[1])
    for text, ids in zip(corpus[1], (dataset[i] for i in range(len(dataset)))):
        assert ids.tolist() == [*tokenizer.tokenize(text), tokenizer.eod]
    assert read_metadata(prefix).tokenizer == TokenizerIdentity.of(tokenizer)
    validate_data_prefix(prefix, tokenizer.vocab_size, TokenizerIdentity.of(tokenizer))


def test_preprocess_workers_rebuild_the_gpt2_tokenizer(corpus, tokenizer_flags, tokenizer_train_data, tmp_path):
    prefix = str(tmp_path / "two")
    flags = tokenizer_flags["GPT2BPETokenizer"]
    preprocess_tool.main(["--input", corpus[0], *flags, "--output-prefix", prefix, "--append-eod", "--workers", "2"])
    for suffix in (".bin", ".idx"):
        one = tokenizer_train_data["GPT2BPETokenizer"][1]
        assert open(prefix + "_text_document" + suffix, "rb").read() == open(one + suffix, "rb").read()


def test_preprocess_refuses_tokenizer_flags_as_training_does(corpus, tokenizer, bytelevel_dir, tmp_path):
    out = ["--input", corpus[0], "--output-prefix", str(tmp_path / "x")]
    with pytest.raises(SystemExit, match="--vocab-file=.*does nothing in this run; it applies only with --tokenizer"):
        preprocess_tool.main([*out, "--tokenizer-model", tokenizer.model_path, "--vocab-file", "v.json"])
    with pytest.raises(SystemExit, match="--merge-file=None: --tokenizer-type GPT2BPETokenizer needs GPT-2's merges"):
        preprocess_tool.main([*out, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"])
    assert not list(tmp_path.iterdir())


def test_data_made_with_another_tokenizer_is_refused_naming_both(tokenizer, tokenizer_train_data):
    """Same vocabulary size (600), other pieces: the GPT-2 data with the sentencepiece model."""
    prefix = tokenizer_train_data["GPT2BPETokenizer"][1]
    with pytest.raises(DataError) as error:
        validate_data_prefix(prefix, tokenizer.vocab_size, TokenizerIdentity.of(tokenizer))
    message = str(error.value)
    assert message.startswith(f"--tokenizer-model {os.path.basename(tokenizer.model_path)} and --data-path {prefix}")
    assert "same size (600) but other pieces" in message and "(vocab.json + merges.txt, per" in message


def test_train_bytelevel_bpe_writes_gpt2_files_deterministically(corpus, bytelevel_dir, tmp_path):
    again = tokenizer_tool.main(
        [
            "--input",
            corpus[0],
            "--model-type",
            "bytelevel-bpe",
            "--model-prefix",
            str(tmp_path / "b"),
            "--vocab-size",
            str(VOCAB),
        ]
    )
    names = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json")
    for name in names:
        assert open(os.path.join(again, name), "rb").read() == open(os.path.join(bytelevel_dir, name), "rb").read()
    assert open(os.path.join(again, "merges.txt")).readline() == "#version: 0.2\n"
    vocab = json.load(open(os.path.join(again, "vocab.json")))
    assert len(vocab) == VOCAB and vocab["<|endoftext|>"] == 0 and sorted(vocab.values()) == list(range(VOCAB))
    with pytest.raises(SystemExit, match="--vocab-size 200 is too small: the 256 bytes each need a piece"):
        tokenizer_tool.main(
            ["--input", corpus[0], "--model-type", "bytelevel-bpe", "--model-prefix", "x", "--vocab-size", "200"]
        )


@pytest.mark.parametrize("kind", TYPES)
def test_the_start_up_summary_names_the_tokenizer_type_and_files(tokenizers, tokenizer_flags, kind, caplog):
    from megatron_moe.model import run_fusions
    from megatron_moe.training.summary import log_startup_summary

    cfg = parse_args(["--data-path", "d", *tokenizer_flags[kind], "--train-iters", "3", "--global-batch-size", "2"])
    tokenizer = tokenizers[kind]
    counts = {"total": 1, "active_per_token": 1, "this_rank": 1}
    with caplog.at_level(logging.INFO, logger="megatron_moe"):
        log_startup_summary(cfg, counts, tokenizer, {}, run_fusions(cfg))
    files = " + ".join(tokenizer.files)
    assert f"data: d (split 98,2,0); tokenizer: {kind} {files}, vocabulary {VOCAB}" in caplog.text
