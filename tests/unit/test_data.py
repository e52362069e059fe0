"""Data pipeline tests: tokenizer, preprocessing, validation, GPT datasets, samplers.

A session fixture builds a small real corpus (this Python's standard library sources) and
trains one small tokenizer on it; every other test builds what it needs in tmp_path.
"""

import json
import os
import sys

import numpy
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_moe.data import DataError, expand_input_paths
from megatron_moe.data.datasets import build_gpt_datasets, parse_data_path, validate_data_prefix
from megatron_moe.data.sampler import (
    CyclicPretrainingSampler,
    PretrainingSampler,
    build_data_loader,
)
from megatron_moe.data.tokenizer import SentencePieceTokenizer, TokenizerError
from tests.conftest import VOCAB, corpus_tool, preprocess_tool, tokenizer_tool  # noqa: F401


def preprocess(input_path, tokenizer, prefix, *extra):
    """Run tools/preprocess_data.py; return the data prefix of the text key."""
    preprocess_tool.main(
        [
            "--input",
            input_path,
            "--tokenizer-model",
            tokenizer.model_path,
            "--output-prefix",
            prefix,
            "--append-eod",
            *extra,
        ]
    )
    return prefix + "_text_document"


def write_jsonl(path, texts):
    """Write texts as a jsonl corpus."""
    with open(path, "w", encoding="utf-8") as stream:
        for text in texts:
            stream.write(json.dumps({"text": text}) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def data_prefix(corpus, tokenizer, tmp_path_factory):
    """The corpus, preprocessed."""
    return preprocess(corpus[0], tokenizer, str(tmp_path_factory.mktemp("data") / "stdlib"))


# ---------------------------------------------------------------------------- tokenizer


def test_corpus_is_deterministic_and_capped(corpus, tmp_path):
    again = str(tmp_path / "again.jsonl")
    count, total = corpus_tool.main(["--output", again, "--max-bytes", "250000"])
    assert open(again, "rb").read() == open(corpus[0], "rb").read()
    assert 0 < total <= 250000 and count == len(corpus[1]) > 3


def test_tokenizer_round_trips_python_source_exactly(corpus, tokenizer):
    tricky = [
        "",
        "\n\n\tx = 1  \r\n",
        "    def f(a,  b):\n\t\treturn a ** 2  # caf\u00e9 \u2603 \U0001f600\n",
        "\x00\x7f" + " " * 40 + "\u00a0end",
    ]
    for text in corpus[1] + tricky:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    ids = tokenizer.tokenize(corpus[1][0])
    assert len(ids) < 0.7 * len(corpus[1][0])  # real merges, not bytes
    assert tokenizer.detokenize(numpy.array(ids)) == corpus[1][0]


def test_tokenizer_special_ids(tokenizer):
    assert tokenizer.vocab_size == VOCAB
    assert (tokenizer.unk, tokenizer.bos, tokenizer.eod, tokenizer.pad) == (0, 1, 2, 3)
    assert tokenizer.eos == tokenizer.eod
    assert len(tokenizer.vocab) == VOCAB and tokenizer.inv_vocab[tokenizer.eod] == "</s>"


def test_model_without_pad_uses_megatron_sentinel(corpus, tmp_path):
    import sentencepiece

    prefix = str(tmp_path / "nopad")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus[1][0].splitlines()),
        model_prefix=prefix,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        pad_id=-1,
        logstream=open(os.devnull, "w"),
    )
    assert SentencePieceTokenizer(prefix + ".model").pad == -1


def test_missing_or_corrupt_tokenizer_model_names_flag_and_path(tmp_path):
    missing = str(tmp_path / "nope.model")
    with pytest.raises(TokenizerError, match="--tokenizer-model") as error:
        SentencePieceTokenizer(missing)
    assert missing in str(error.value)
    corrupt = tmp_path / "corrupt.model"
    corrupt.write_bytes(b"not a sentencepiece model")
    with pytest.raises(TokenizerError, match="--tokenizer-model") as error:
        SentencePieceTokenizer(str(corrupt))
    assert str(corrupt) in str(error.value)


def test_train_tokenizer_rejects_tiny_vocab(corpus, tmp_path):
    with pytest.raises(SystemExit, match="--vocab-size 100"):
        tokenizer_tool.main(["--input", corpus[0], "--model-prefix", str(tmp_path / "t"), "--vocab-size", "100"])


# ------------------------------------------------------------------------ preprocessing


def test_preprocess_reads_back_exactly(corpus, tokenizer, data_prefix):
    dataset = IndexedDataset(data_prefix)
    assert len(dataset) == len(corpus[1])
    assert dataset.index.dtype == numpy.uint16
    for text, ids in zip(corpus[1], (dataset[i] for i in range(len(dataset)))):
        assert ids[-1] == tokenizer.eod
        assert tokenizer.detokenize(ids[:-1]) == text
    summary = validate_data_prefix(data_prefix, tokenizer.vocab_size)
    assert summary.num_documents == len(corpus[1])
    assert summary.num_tokens == sum(len(dataset[i]) for i in range(len(dataset)))


def test_preprocess_workers_output_identical(corpus, tokenizer, data_prefix, tmp_path):
    parallel = preprocess(corpus[0], tokenizer, str(tmp_path / "w2"), "--workers", "2")
    for suffix in (".bin", ".idx"):
        assert open(parallel + suffix, "rb").read() == open(data_prefix + suffix, "rb").read()
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_preprocess_plain_text_directory(tokenizer, tmp_path):
    source = tmp_path / "src"
    (source / "pkg").mkdir(parents=True)
    texts = {"a.py": "import os\r\nprint(os.sep)\n", "pkg/b.txt": "  two\n\nlines  "}
    for name, text in texts.items():
        (source / name).write_bytes(text.encode("utf-8"))
    prefix = preprocess(str(source), tokenizer, str(tmp_path / "plain"))
    dataset = IndexedDataset(prefix)
    got = [tokenizer.detokenize(dataset[i][:-1]) for i in range(len(dataset))]
    assert got == [texts[name] for name in sorted(texts)]


def test_interrupted_preprocess_leaves_no_files(tokenizer, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", ["fine"] * 5)
    with open(source, "a") as stream:
        stream.write("{broken json\n")
    with pytest.raises(DataError, match="in.jsonl:6"):
        preprocess(source, tokenizer, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_missing_input_names_flag(tmp_path):
    with pytest.raises(DataError, match="--input"):
        expand_input_paths([str(tmp_path / "*.jsonl")])


# --------------------------------------------------------------------------- validation


def copy_prefix(prefix, tmp_path, name="copy"):
    """Copy PREFIX.bin/.idx into tmp_path; return the new prefix."""
    target = str(tmp_path / name)
    for suffix in (".bin", ".idx"):
        with open(prefix + suffix, "rb") as src, open(target + suffix, "wb") as dst:
            dst.write(src.read())
    return target


def test_missing_bin_names_flag_file_and_fix(data_prefix, tmp_path):
    prefix = copy_prefix(data_prefix, tmp_path)
    os.remove(prefix + ".bin")
    with pytest.raises(DataError, match="--data-path") as error:
        validate_data_prefix(prefix, VOCAB)
    assert prefix + ".bin" in str(error.value) and "tools.preprocess_data" in str(error.value)


@pytest.mark.parametrize("suffix", [".idx", ".bin"])
def test_truncated_files_name_the_file(data_prefix, tmp_path, suffix):
    prefix = copy_prefix(data_prefix, tmp_path)
    size = os.path.getsize(prefix + suffix)
    os.truncate(prefix + suffix, size - 10)
    with pytest.raises(DataError, match="truncated or corrupt") as error:
        validate_data_prefix(prefix, VOCAB)
    assert prefix + suffix in str(error.value)


def test_vocab_smaller_than_data(data_prefix):
    with pytest.raises(DataError, match=r"tokenizer vocabulary \(300\) smaller") as error:
        validate_data_prefix(data_prefix, 300)
    assert data_prefix + ".bin" in str(error.value)


@pytest.mark.parametrize(
    "value", [[], ["0.5", "a", "b"], ["x", "a", "0.5", "b"], ["-1", "a", "2", "b"], ["0", "a", "0", "b"]]
)
def test_malformed_data_path(value):
    with pytest.raises(DataError, match="--data-path"):
        parse_data_path(value)


def test_parse_data_path():
    assert parse_data_path(["p"]) == (["p"], None)
    assert parse_data_path(["1", "a", "3", "b"]) == (["a", "b"], [1.0, 3.0])


# ----------------------------------------------------------------------------- datasets


def build(data_path, tokenizer, cache_dir, split="90,10,0", train=40, valid=8, seq=32):
    """build_gpt_datasets with small defaults."""
    return build_gpt_datasets(
        data_path=data_path,
        split=split,
        tokenizer=tokenizer,
        seq_length=seq,
        seed=1234,
        train_samples=train,
        valid_samples=valid,
        test_samples=0,
        cache_dir=cache_dir,
        is_built_on_rank=lambda: True,
    )


def test_single_prefix_datasets_are_cached_and_reproducible(data_prefix, tokenizer, tmp_path):
    cache = str(tmp_path / "cache")
    train, valid, test = build([data_prefix], tokenizer, cache)
    assert test is None and len(train) >= 40 and len(valid) >= 8
    sample = train[3]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert sample["tokens"].shape == (32,) and torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert any(name.endswith("shuffle_index.npy") for name in os.listdir(cache))
    again = build([data_prefix], tokenizer, cache)[0]
    assert torch.equal(again[3]["tokens"], sample["tokens"])


def make_two_sources(tokenizer, tmp_path):
    """Two preprocessed prefixes with different content."""
    first = write_jsonl(tmp_path / "a.jsonl", [f"alpha {i} " * 20 for i in range(30)])
    second = write_jsonl(tmp_path / "b.jsonl", [f"def beta_{i}():\n    pass\n" * 8 for i in range(30)])
    return (preprocess(first, tokenizer, str(tmp_path / "a")), preprocess(second, tokenizer, str(tmp_path / "b")))


def check_blend(train, tokenizer):
    """The blend draws from both prefixes, roughly by weight."""
    ids = [int(train[i]["dataset_id"]) for i in range(len(train))]
    assert len(train) == 200 and set(ids) == {0, 1}
    assert 40 < ids.count(0) < 80  # weight 0.3 of 200
    texts = {int(train[i]["dataset_id"]): tokenizer.detokenize(train[i]["tokens"]) for i in range(20)}
    assert "alpha" in texts[0] and "beta" in texts[1]


def test_blend_samples_from_both(tokenizer, tmp_path):
    a, b = make_two_sources(tokenizer, tmp_path)
    train, valid, _ = build(["0.3", a, "0.7", b], tokenizer, str(tmp_path / "cache"), train=200)
    check_blend(train, tokenizer)
    assert len(valid) >= 8  # per-source sizes are rounded up


def test_blend_with_torch_distributed(tokenizer, tmp_path):
    a, b = make_two_sources(tokenizer, tmp_path)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        cache = str(tmp_path / "cache")
        train = build(["0.3", a, "0.7", b], tokenizer, cache, train=200)[0]
        check_blend(train, tokenizer)
        assert any("BlendedDataset" in name for name in os.listdir(cache))
    finally:
        torch.distributed.destroy_process_group()


def test_split_without_documents_is_refused(tokenizer, tmp_path):
    prefix = preprocess(write_jsonl(tmp_path / "few.jsonl", ["x = 1\n"] * 5), tokenizer, str(tmp_path / "few"))
    with pytest.raises(DataError, match="--split 98,2,0: the valid split"):
        build([prefix], tokenizer, None, split="98,2,0")
    with pytest.raises(DataError, match="--split"):
        build([prefix], tokenizer, None, split="a,b")


def test_a_split_asked_for_no_samples_is_not_built(tokenizer, tmp_path):
    """--eval-iters 0 asks the valid split for nothing: its share may hold no document (seen on a GPU host, whose
    Python's stdlib corpus has fewer, larger files), and the train split keeps its own documents."""
    prefix = preprocess(write_jsonl(tmp_path / "few.jsonl", ["x = 1\n"] * 5), tokenizer, str(tmp_path / "few"))
    train, valid, test = build([prefix], tokenizer, None, split="98,2,0", train=4, valid=0, seq=4)
    assert valid is None and test is None and len(train) >= 4
    whole = build([prefix], tokenizer, None, split="100,0,0", train=4, valid=0, seq=4)[0]
    assert torch.equal(train[0]["tokens"], whole[0]["tokens"])


# ----------------------------------------------------------------------------- samplers


def run_sampler(consumed, rank, size, total=50, mbs=3, **kw):
    """All micro-batches of one rank."""
    return list(PretrainingSampler(total, consumed, mbs, rank, size, **kw))


def test_sampler_resume_and_disjoint_ranks():
    straight = run_sampler(0, 0, 1)
    assert run_sampler(12, 0, 1) == straight[4:]
    ranks = [run_sampler(6, r, 2) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(PretrainingSampler(50, 6, 3, 1, 2))
    flat = [i for r in ranks for batch in r for i in batch]
    assert len(flat) == len(set(flat)) and min(flat) == 6
    assert ranks[0][0] == [6, 7, 8] and ranks[1][0] == [9, 10, 11]
    assert run_sampler(0, 0, 1, total=10, drop_last=False)[-1] == [9]
    with pytest.raises(ValueError, match="data_parallel_rank"):
        PretrainingSampler(10, 0, 2, 2, 2)


def test_cyclic_sampler_wraps_forever():
    batches = CyclicPretrainingSampler(5, 0, 2, 1, 2)
    iterator = iter(batches)
    assert [next(iterator) for _ in range(3)] == [[2, 3], [1, 2], [0, 1]]


def test_data_loader_batches(data_prefix, tokenizer, tmp_path):
    train, valid, _ = build([data_prefix], tokenizer, str(tmp_path / "cache"))
    loader = build_data_loader(
        train, consumed_samples=4, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2
    )
    batch = next(iter(loader))
    assert batch["tokens"].shape == (2, 32) and batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["tokens"][0], train[6]["tokens"])
    cyclic = iter(build_data_loader(valid, 0, 4, 0, 1, cyclic=True))
    batches = [next(cyclic) for _ in range(len(valid) + 1)]
    assert all(b["tokens"].shape == (4, 32) for b in batches)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
