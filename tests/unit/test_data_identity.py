"""The data is part of a run's identity: a prefix rebuilt in place never reads megatron-core's index cache made
for its old contents, and a resume on other data is refused naming the prefix and what changed, unless
--allow-data-change says it is intended (data/fingerprint.py, checkpointing/load.py `check_same_data`)."""

import json
import logging

import numpy
import pytest

from megatron_moe.config import ConfigError, parse_args
from megatron_moe.data.fingerprint import data_changes, data_record, fingerprint_prefix
from tests.conftest import preprocess_tool
from tests.unit.test_data_startup import build, copy_prefix


def preprocess(directory, documents, tokenizer, name="data"):
    """`documents` written to a jsonl and preprocessed to DIRECTORY/NAME (again: rebuilt in place)."""
    source = directory / f"{name}-{len(documents)}.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    output = str(directory / name)
    preprocess_tool.main(
        ["--input", str(source), "--tokenizer-model", tokenizer.model_path, "--output-prefix", output, "--append-eod"]
    )
    return output + "_text_document"


def indices(prefix, tokenizer):
    """What the train split reads, through megatron-core's default cache PREFIX/cache/: (documents in its index,
    samples, every sample's tokens); an IndexError where the cache describes more data than there is."""
    train, _, _ = build(prefix, tokenizer, None)
    samples = [train[i]["tokens"].tolist() for i in range(len(train))]
    return len(train.document_index), len(train), samples


@pytest.mark.parametrize("rebuilt_with", ["more documents", "fewer documents"])
def test_a_prefix_rebuilt_in_place_never_reads_the_index_cache_of_its_old_contents(
    corpus, tokenizer, tmp_path, rebuilt_with
):
    """main: megatron-core's key ignores the contents: the larger corpus was read as the old one's documents and
    samples (11 documents and 1,420 samples where a clean cache has 24 and 3,601), the smaller one failed with an
    IndexError."""
    documents = corpus[1]
    prefix = preprocess(tmp_path, documents[:12], tokenizer)
    first = indices(prefix, tokenizer)
    prefix = preprocess(tmp_path, documents if rebuilt_with == "more documents" else documents[:5], tokenizer)
    clean = copy_prefix(prefix, tmp_path, "clean")  # the same files with a cache of their own
    assert indices(prefix, tokenizer) == indices(clean, tokenizer) != first


def test_fingerprints_name_what_changed(corpus, tokenizer, tmp_path):
    documents = corpus[1]
    prefix = preprocess(tmp_path, documents[:12], tokenizer)
    old = data_record([prefix], False)
    assert data_changes(old, data_record([copy_prefix(prefix, tmp_path, "moved")], False)) == []  # same contents
    tokens = numpy.memmap(prefix + ".bin", dtype=numpy.uint16, mode="r+")
    tokens[-1] = (int(tokens[-1]) + 1) % 600  # the last sampled block: same sizes, other contents
    tokens.flush()
    del tokens
    same_sizes = f"--data-path {prefix}: same sizes, other contents (.bin)"
    assert data_changes(old, data_record([prefix], False)) == [same_sizes]

    grown = fingerprint_prefix(preprocess(tmp_path, documents[:14], tokenizer))
    (change,) = data_changes(old, data_record([prefix], False))
    was = old["fingerprints"][0]
    assert change == (
        f"--data-path {prefix}: .bin bytes {was['bin_bytes']} -> {grown.bin_bytes}, .idx bytes {was['idx_bytes']} "
        f"-> {grown.idx_bytes}, documents 12 -> 14"
    )
    blend = data_record(["0.5", prefix, "0.5", prefix], False)
    reweighted = data_record(["0.7", prefix, "0.3", prefix], False)
    assert data_changes(blend, reweighted) == ["blend weights 0.5 0.5 -> 0.7 0.3"]
    assert data_changes(data_record([prefix], False), data_record(["1.0", prefix], False)) == []  # a blend of one
    assert data_changes(old, data_record([], True)) == [
        f"the checkpoint was trained on --data-path {prefix}, this run reads --mock-data"
    ]


def test_resume_on_other_data_is_refused_unless_allowed(megatron_world1, corpus, tokenizer, tmp_path, caplog):
    """A checkpoint records its data; --load on other data: one ConfigError naming the prefix and the change
    (main: loaded without a word); --allow-data-change: loaded with a warning listing it; a checkpoint saved
    without a record: loaded with one warning that the data could not be checked."""
    from megatron_moe.checkpointing import TrainState, load_checkpoint, save_checkpoint
    from megatron_moe.model import transformer_config
    from megatron_moe.training.setup import build_ddp_model, build_optimizer, build_scheduler

    prefix = preprocess(tmp_path, corpus[1][:12], tokenizer)
    tiny = "--num-layers 1 --hidden-size 64 --num-attention-heads 4 --num-experts 4 --seq-length 32"
    flags = [*tiny.split(), "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2"]

    def run(*extra):
        cfg = parse_args(["--data-path", prefix, "--tokenizer-model", "t", "--load", "x", *flags, *extra])
        cfg.validate(world_size=1)
        return cfg

    cfg = run()
    model = build_ddp_model(cfg, transformer_config(cfg), 128)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    objects = (model, optimizer, scheduler)
    saved = data_record(cfg.data.data_path, False)
    # Iteration 0 (no optimizer state yet): what is checked is read before any tensor.
    path = save_checkpoint(str(tmp_path / "ckpt"), cfg, *objects, TrainState(), data=saved)
    assert load_checkpoint(path, cfg, *objects, data=saved).iteration == 0  # the same data

    preprocess(tmp_path, corpus[1][:14], tokenizer)  # rebuilt in place
    now = data_record(cfg.data.data_path, False)
    with pytest.raises(ConfigError) as error:
        load_checkpoint(path, cfg, *objects, data=now)
    text = str(error.value)
    assert text.startswith(f"--load={path}: the data differs from the checkpoint's: --data-path {prefix}: .bin bytes")
    assert "documents 12 -> 14" in text and text.endswith("add --allow-data-change if the change is intended")

    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        assert load_checkpoint(path, run("--allow-data-change"), *objects, data=now).iteration == 0
        unrecorded = save_checkpoint(str(tmp_path / "old"), cfg, *objects, TrainState())
        assert load_checkpoint(unrecorded, cfg, *objects, data=now).iteration == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "megatron_moe"]
    assert f"--load={path}: resuming on other data (--allow-data-change): --data-path {prefix}: " in warnings[0]
    assert warnings[1] == f"--load={unrecorded}: saved without a record of its data, so the data could not be checked"
    assert len(warnings) == 2, warnings
