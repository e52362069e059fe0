"""Data start-up at corpus scale: the metadata sidecar, and start-up never reading the .bin's tokens.

tools/preprocess_data.py writes PREFIX.meta.json (largest token id, counts, the tokenizer's
identity); start-up checks the tokenizer against it instead of scanning the .bin. Data without
it is scanned once (the result cached by the data's fingerprint) with a warning; `--write-metadata`
writes the file.
"""

import ctypes
import hashlib
import json
import logging
import mmap
import os
import shutil
import sys

import numpy
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from megatron_moe.data import DataError
from megatron_moe.data.datasets import SCAN_CACHE, build_gpt_datasets, validate_data_prefix
from megatron_moe.data.fingerprint import SAMPLE_BLOCKS
from megatron_moe.data.metadata import SUFFIX, TokenizerIdentity, metadata_path, read_metadata
from tests.conftest import VOCAB, preprocess_tool


def copy_prefix(prefix, directory, name="copy", sidecar=False):
    """PREFIX.bin/.idx (and its sidecar) copied into `directory`; returns the new prefix."""
    target = str(directory / name)
    for suffix in (".bin", ".idx", *((SUFFIX,) if sidecar else ())):
        shutil.copyfile(prefix + suffix, target + suffix)
    return target


def build(prefix, tokenizer, cache_dir):
    return build_gpt_datasets(
        data_path=[prefix],
        split="90,10,0",
        tokenizer=tokenizer,
        seq_length=32,
        seed=1,
        train_samples=40,
        valid_samples=8,
        test_samples=0,
        cache_dir=cache_dir,
        is_built_on_rank=lambda: True,
    )


def true_max_token_id(prefix):
    dataset = IndexedDataset(prefix)
    return max(int(dataset[i].max()) for i in range(len(dataset)))


def test_preprocess_writes_the_sidecar_start_up_reads(train_data, tokenizer):
    prefix, model_path = train_data
    with open(metadata_path(prefix), encoding="utf-8") as stream:
        raw = json.load(stream)
    assert raw["format"] == "megatron_moe.tokenized_data" and raw["version"] == 1
    meta = read_metadata(prefix)
    assert meta.max_token_id == true_max_token_id(prefix) and 0 < meta.max_token_id < VOCAB
    summary = validate_data_prefix(prefix, VOCAB)
    counts = (meta.num_tokens, meta.num_sequences, meta.num_documents)
    assert counts == (summary.num_tokens, summary.num_sequences, summary.num_documents)
    assert summary.max_token_id == meta.max_token_id
    assert meta.dtype == "uint16" and meta.bin_bytes == os.path.getsize(prefix + ".bin") == 2 * meta.num_tokens
    assert meta.tokenizer == TokenizerIdentity.of(tokenizer)
    assert meta.tokenizer.vocab_size == VOCAB and meta.tokenizer.model_file == os.path.basename(model_path)
    assert meta.tokenizer.model_sha256 == hashlib.sha256(open(model_path, "rb").read()).hexdigest()
    assert not [f for f in os.listdir(os.path.dirname(prefix)) if ".tmp" in f]


def test_identity_tells_vocabularies_apart(corpus, tokenizer, tmp_path):
    """Same size, different pieces: the pieces hash differs (what a both-ways vocabulary check needs)."""
    import sentencepiece

    from megatron_moe.data.tokenizer import SentencePieceTokenizer

    other = str(tmp_path / "other")
    sentencepiece.SentencePieceTrainer.train(
        input=corpus[0],
        model_prefix=other,
        vocab_size=VOCAB,
        model_type="unigram",
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        minloglevel=2,
        logstream=open(os.devnull, "w"),
    )
    theirs, ours = TokenizerIdentity.of(SentencePieceTokenizer(other + ".model")), TokenizerIdentity.of(tokenizer)
    assert theirs.pieces_sha256 != ours.pieces_sha256 and theirs.model_sha256 != ours.model_sha256


def test_data_without_sidecar_is_scanned_once_and_checked_until_one_is_written(train_data, tokenizer, tmp_path, caplog):
    """A prefix without PREFIX.meta.json (as Megatron-LM's preprocess_data.py leaves it): its largest token id is
    scanned once, cached under the index cache, and checked like a sidecar's; a warning says how to write one."""
    prefix = copy_prefix(train_data[0], tmp_path)
    true_max = true_max_token_id(prefix)
    with pytest.raises(DataError) as error:  # main: not checked, a 300-piece tokenizer passed
        validate_data_prefix(prefix, 300)
    assert str(error.value).startswith(
        f"tokenizer vocabulary (300) smaller than the data's token ids (max {true_max}) in {prefix}.bin"
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        summary = validate_data_prefix(prefix, VOCAB)
        train, valid, _ = build(prefix, tokenizer, str(tmp_path / "cache"))
    assert summary.max_token_id == true_max and len(train) >= 40 and len(valid) >= 8
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all(metadata_path(prefix) in w for w in warnings), warnings
    assert f"--write-metadata {prefix} --tokenizer-model" in warnings[0]
    assert f"token id is {true_max} (an earlier scan's" in warnings[0]

    preprocess_tool.main(["--write-metadata", prefix, "--tokenizer-model", tokenizer.model_path])
    written, made = read_metadata(prefix), read_metadata(train_data[0])
    assert written.written_by.endswith("--write-metadata")
    assert {**vars(written), "written_by": ""} == {**vars(made), "written_by": ""}  # the scan agrees
    with pytest.raises(DataError, match=r"tokenizer vocabulary \(300\) smaller than the data's token ids"):
        validate_data_prefix(prefix, 300)


def test_the_scan_is_cached_by_the_data_contents(train_data, tmp_path):
    """The scan's result is read back at the next start (a forged value shows it is not scanned again); other
    contents at the same prefix are scanned again; a cache that cannot be written is said, and still checked."""
    prefix = copy_prefix(train_data[0], tmp_path)
    cache = tmp_path / "cache"
    first = validate_data_prefix(prefix, VOCAB, cache_dir=str(cache)).max_token_id
    (cached,) = (cache / SCAN_CACHE).iterdir()
    assert json.loads(cached.read_text())["max_token_id"] == first == true_max_token_id(prefix)
    cached.write_text(json.dumps({"max_token_id": 7}))
    assert validate_data_prefix(prefix, VOCAB, cache_dir=str(cache)).max_token_id == 7  # read, not scanned
    cached.write_text("null")  # valid JSON of another shape: scanned over
    assert validate_data_prefix(prefix, VOCAB, cache_dir=str(cache)).max_token_id == first

    tokens = numpy.memmap(prefix + ".bin", dtype=numpy.uint16, mode="r+")
    tokens[0] = VOCAB + 50  # rewritten in place: same sizes, other contents (the first sampled block)
    tokens.flush()
    del tokens
    with pytest.raises(DataError, match=rf"smaller than the data's token ids \(max {VOCAB + 50}\)"):
        validate_data_prefix(prefix, VOCAB, cache_dir=str(cache))
    assert len(list((cache / SCAN_CACHE).iterdir())) == 2

    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with pytest.raises(DataError, match=rf"\(max {VOCAB + 50}\)"):
        validate_data_prefix(prefix, VOCAB, cache_dir=str(blocked))


def test_tokens_beyond_the_vocabulary_without_sidecar_are_refused_before_training(tokenizer, tmp_path):
    """A .bin made with a larger vocabulary and no sidecar: one line naming the file, its largest id and the
    vocabulary (main: accepted, then `IndexError: index out of range in self` at step 1)."""
    prefix = str(tmp_path / "big_ids")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for i in range(40):
        builder.add_item(torch.tensor([5, 9, 2, 7] * 20 + ([VOCAB + 100] if i == 30 else []) + [2]))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    with pytest.raises(DataError) as error:
        build(prefix, tokenizer, str(tmp_path / "cache"))
    assert str(error.value) == (
        f"tokenizer vocabulary ({VOCAB}) smaller than the data's token ids (max {VOCAB + 100}) in {prefix}.bin; "
        "use the tokenizer the data was preprocessed with (--tokenizer-model, or --vocab-file/--merge-file)"
    )


def test_write_metadata_refuses_a_tokenizer_too_small_for_the_data(tokenizer, tmp_path):
    prefix = str(tmp_path / "big_ids")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for ids in ([5, 9, 2], [VOCAB + 100, 2]):
        builder.add_item(torch.tensor(ids))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    expected = rf"vocabulary \({VOCAB}\) smaller than the data's token ids \(max {VOCAB + 100}\)"
    with pytest.raises(DataError, match=expected):
        preprocess_tool.main(["--write-metadata", prefix, "--tokenizer-model", tokenizer.model_path])
    assert not os.path.exists(metadata_path(prefix))


def test_write_metadata_flags_are_checked(tokenizer):
    with pytest.raises(SystemExit, match="--write-metadata describes existing data; drop --input"):
        preprocess_tool.main(["--write-metadata", "p", "--input", "x", "--tokenizer-model", tokenizer.model_path])
    with pytest.raises(SystemExit, match="--output-prefix is required"):
        preprocess_tool.main(["--input", "x.jsonl", "--tokenizer-model", tokenizer.model_path])


def test_stale_or_corrupt_sidecar_is_refused_with_the_fix(train_data, tmp_path):
    prefix = copy_prefix(train_data[0], tmp_path, sidecar=True)
    assert validate_data_prefix(prefix, VOCAB).max_token_id is not None
    meta = json.loads(open(metadata_path(prefix)).read())
    meta["num_tokens"] += 1
    open(metadata_path(prefix), "w").write(json.dumps(meta))
    with pytest.raises(DataError, match=r"--data-path .*: .*\.meta\.json does not describe .*num_tokens: metadata"):
        validate_data_prefix(prefix, VOCAB)
    meta["num_tokens"] = "12"
    open(metadata_path(prefix), "w").write(json.dumps(meta))
    with pytest.raises(DataError, match=r"metadata file .*\.meta\.json is unusable \(num_tokens not an integer\)"):
        validate_data_prefix(prefix, VOCAB)
    open(metadata_path(prefix), "w").write("{not json")
    with pytest.raises(DataError, match=r"metadata file .*\.meta\.json is unusable .*--write-metadata"):
        validate_data_prefix(prefix, VOCAB)


# ------------------------------------------------------------- start-up reads no token of the .bin


def resident_pages(path):
    """(pages of `path` in the page cache, pages in all), by mincore(2) on a fresh mapping of it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        vector = (ctypes.c_ubyte * pages)()
        assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
        libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vector), pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) page residency is Linux's")
def test_start_up_never_touches_the_bin_tokens(train_data, tokenizer, tmp_path):
    """Validation and dataset building (cold and warm index cache) leave the .bin's pages unread but the
    fingerprint's sampled blocks (data/fingerprint.py: at most SAMPLE_BLOCKS pages, whatever the size).

    The .bin is a sparse file of the right size (no page of it cached), beside the real .idx and
    sidecar; a page read by anyone (numpy, mmap, read) shows up in mincore. Reading the samples
    afterwards must show up, or this check could not fail.
    """
    source = train_data[0]
    prefix = str(tmp_path / "sparse")
    for suffix in (".idx", SUFFIX):
        shutil.copyfile(source + suffix, prefix + suffix)
    with open(prefix + ".bin", "wb") as stream:
        stream.truncate(os.path.getsize(source + ".bin"))
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    resident, pages = resident_pages(prefix + ".bin")
    if resident:
        pytest.skip(f"cannot start with the .bin out of the page cache here ({resident}/{pages} pages)")
    assert pages > 2 * SAMPLE_BLOCKS
    for cache in ("cold", "warm"):
        summary = validate_data_prefix(prefix, VOCAB)
        train, valid, _ = build(prefix, tokenizer, str(tmp_path / "cache"))
        assert summary.max_token_id == read_metadata(source).max_token_id and len(train) >= 40
        assert resident_pages(prefix + ".bin")[0] <= SAMPLE_BLOCKS, cache
    assert all(train[i]["tokens"].shape == (32,) for i in range(40))
    assert resident_pages(prefix + ".bin")[0] > SAMPLE_BLOCKS  # the check sees a read


# ------------------------------------------------- the .idx against the .bin, the tokenizer against the data


def idx_arrays(prefix):
    """(lengths, offsets, document boundaries) of PREFIX.idx as writable memmaps, for corrupting them."""
    head = open(prefix + ".idx", "rb").read(34)
    seqs, docs = int.from_bytes(head[18:26], "little"), int.from_bytes(head[26:34], "little")
    lengths = numpy.memmap(prefix + ".idx", dtype=numpy.int32, mode="r+", offset=34, shape=(seqs,))
    offsets = numpy.memmap(prefix + ".idx", dtype=numpy.int64, mode="r+", offset=34 + 4 * seqs, shape=(seqs,))
    documents = numpy.memmap(prefix + ".idx", dtype=numpy.int64, mode="r+", offset=34 + 12 * seqs, shape=(docs,))
    return lengths, offsets, documents


def corrupt_permuted(lengths, offsets, documents):
    offsets[[1, 2]] = offsets[[2, 1]]


def corrupt_past_the_end(lengths, offsets, documents):
    offsets[-1] += 1000


def corrupt_lengths_moved(lengths, offsets, documents):
    lengths[0] += 3  # the sum still matches the .bin: another sequence shrinks by as much
    lengths[1] -= 3


def corrupt_documents(lengths, offsets, documents):
    documents[[1, 2]] = documents[[2, 1]]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (corrupt_permuted, r"sequence 1 starts at byte \d+ of the \.bin, but the sequences before it end at byte"),
        (corrupt_past_the_end, r"sequence \d+ starts at byte \d+ of the \.bin, but"),
        (corrupt_lengths_moved, r"sequence 1 starts at byte \d+ of the \.bin, but"),
        (corrupt_documents, r"document boundaries do not run from 0 to its \d+ sequences in order"),
    ],
)
def test_idx_offsets_that_do_not_tile_the_bin_are_refused_naming_the_file(train_data, tmp_path, corrupt, message):
    prefix = copy_prefix(train_data[0], tmp_path, sidecar=True)
    validate_data_prefix(prefix, VOCAB)  # intact before
    arrays = idx_arrays(prefix)
    corrupt(*arrays)
    for array in arrays:
        array.flush()
    del arrays
    with pytest.raises(DataError, match=message) as error:
        validate_data_prefix(prefix, VOCAB)
    assert str(error.value).startswith(f"--data-path: index file {prefix}.idx is corrupt"), str(error.value)


def forge_sidecar_tokenizer(prefix, **changes):
    path = metadata_path(prefix)
    meta = json.loads(open(path).read())
    meta["tokenizer"].update(changes)
    open(path, "w").write(json.dumps(meta))


OTHER = "f" * 64
MADE_WITH = r"has {} pieces but the data was made with a {}-piece vocabulary"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"vocab_size": VOCAB + 128, "pieces_sha256": OTHER}, MADE_WITH.format(VOCAB, VOCAB + 128)),
        ({"vocab_size": VOCAB - 128, "pieces_sha256": OTHER}, MADE_WITH.format(VOCAB, VOCAB - 128)),
        ({"pieces_sha256": OTHER}, rf"same size \({VOCAB}\) but other pieces: .* \(other\.model, per .*\) ffffff"),
    ],
)
def test_a_tokenizer_with_another_vocabulary_is_refused_both_ways(train_data, tokenizer, tmp_path, changes, message):
    prefix = copy_prefix(train_data[0], tmp_path, sidecar=True)
    forge_sidecar_tokenizer(prefix, model_file="other.model", **changes)
    with pytest.raises(DataError, match=message) as error:
        build(prefix, tokenizer, str(tmp_path / "cache"))
    text = str(error.value)
    assert text.startswith(f"--tokenizer-model {os.path.basename(tokenizer.model_path)} and --data-path {prefix}:")
    assert metadata_path(prefix) in text


def test_the_same_vocabulary_in_another_model_file_is_accepted(train_data, tokenizer, tmp_path):
    prefix = copy_prefix(train_data[0], tmp_path, sidecar=True)
    forge_sidecar_tokenizer(prefix, model_file="renamed.model", model_sha256="0" * 64)  # e.g. re-saved
    train, valid, _ = build(prefix, tokenizer, str(tmp_path / "cache"))
    assert len(train) >= 40 and len(valid) >= 8
