#!/usr/bin/env python
"""Train a tokenizer on jsonl or plain-text files: SentencePiece (BPE or unigram) or GPT-2's byte-level BPE.

``--model-type bpe`` (the default) or ``unigram``: a SentencePiece model, set up for source code and any other
text: byte fallback (no text is ever unknown), identity normalization, whitespace kept exactly (runs of spaces
may form pieces), digits split, no dummy prefix. ``detokenize(tokenize(x)) == x`` for any string. Special ids:
unk=0, bos=1, eos=2 (the end-of-document id), pad=3. Writes PREFIX.model and PREFIX.vocab
(``--tokenizer-type SentencePieceTokenizer --tokenizer-model PREFIX.model``).

``--model-type bytelevel-bpe``: GPT-2's byte-level BPE, trained with HuggingFace's ``tokenizers`` on whole
documents (GPT-2's regex pre-split, so newlines and indentation form pieces too); every string round-trips;
``<|endoftext|>`` (id 0) is the end of document. Writes the directory PREFIX/ with ``vocab.json`` and
``merges.txt`` (``--tokenizer-type GPT2BPETokenizer --vocab-file PREFIX/vocab.json --merge-file
PREFIX/merges.txt``) and the same tokenizer as ``tokenizer.json`` with a ``tokenizer_config.json``
(``--tokenizer-type HuggingFaceTokenizer --tokenizer-model PREFIX``; transformers' AutoTokenizer loads it).

Examples:
    python -m tools.train_tokenizer --input data/stdlib.jsonl \
        --model-prefix data/tokenizer --vocab-size 4096
    python -m tools.train_tokenizer --input data/stdlib.jsonl --model-type bytelevel-bpe \
        --model-prefix data/bpe --vocab-size 4096
"""

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Iterable, Iterator

import sentencepiece
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatron_moe.data import DataError, expand_input_paths, iter_documents
from tools.cli import HelpFormatter

SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
BYTE_PIECES = 256
SENTENCEPIECE_TYPES = ("bpe", "unigram")
BYTELEVEL = "bytelevel-bpe"
MODEL_TYPES = (*SENTENCEPIECE_TYPES, BYTELEVEL)
ENDOFTEXT = "<|endoftext|>"  # GPT-2's end of document (megatron_moe.data.tokenizer.huggingface.ENDOFTEXT)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files, directories or globs; .jsonl/.json are JSON lines, any other file is one document",
    )
    parser.add_argument("--json-key", default="text", help="JSON key holding the text")
    parser.add_argument(
        "--model-prefix",
        required=True,
        help="SentencePiece: writes PREFIX.model and PREFIX.vocab; bytelevel-bpe: the directory PREFIX/ with "
        "vocab.json, merges.txt, tokenizer.json and tokenizer_config.json",
    )
    parser.add_argument("--vocab-size", type=int, default=8000, help="tokens in the vocabulary")
    parser.add_argument(
        "--model-type",
        choices=MODEL_TYPES,
        default="bpe",
        help="SentencePiece's bpe or unigram, or GPT-2's byte-level BPE (bytelevel-bpe, HuggingFace tokenizers; "
        "--input-sentence-size, --max-sentence-length, --character-coverage and --num-threads are SentencePiece's)",
    )
    parser.add_argument(
        "--input-sentence-size",
        type=int,
        default=1_000_000,
        help="train on at most this many lines, sampled with --seed (0: all)",
    )
    parser.add_argument(
        "--max-sentence-length", type=int, default=16384, help="longest line in bytes; longer lines are cut into pieces"
    )
    parser.add_argument(
        "--num-threads", type=int, default=os.cpu_count() or 1, help="trainer threads (default: this host's cores)"
    )
    parser.add_argument(
        "--character-coverage",
        type=float,
        default=0.9995,
        help="share of characters given their own piece; rarer characters fall back to byte pieces",
    )
    parser.add_argument("--seed", type=int, default=1234, help="seed of the line sampling")
    parser.add_argument("--verbose", action="store_true", help="show SentencePiece's log")
    return parser


def validate_args(args: argparse.Namespace) -> None:
    """Reject values SentencePiece would fail on late or obscurely."""
    specials = 1 if args.model_type == BYTELEVEL else len(SPECIAL_IDS)
    minimum = BYTE_PIECES + specials + 1
    if args.vocab_size < minimum:
        raise SystemExit(
            f"--vocab-size {args.vocab_size} is too small: the {BYTE_PIECES} bytes each need a piece, plus "
            f"{specials} special piece(s); use at least {minimum} (e.g. 4096)"
        )
    if args.input_sentence_size < 0:
        raise SystemExit(
            f"--input-sentence-size {args.input_sentence_size} is negative; "
            f"use 0 (all lines) or a positive cap such as 1000000"
        )
    if args.max_sentence_length < 16:
        raise SystemExit(f"--max-sentence-length {args.max_sentence_length} is too small; use e.g. 16384")
    if not 0.0 < args.character_coverage <= 1.0:
        raise SystemExit(f"--character-coverage {args.character_coverage} is outside (0, 1]; use e.g. 0.9995")
    if args.num_threads < 1:
        raise SystemExit(f"--num-threads {args.num_threads} must be >= 1")


def split_long_line(line: str, max_bytes: int) -> Iterator[str]:
    """Cut a line into pieces of at most ``max_bytes`` UTF-8 bytes (4 bytes per char max)."""
    if len(line.encode("utf-8")) <= max_bytes:
        yield line
        return
    step = max(1, max_bytes // 4)
    for start in range(0, len(line), step):
        yield line[start : start + step]


def iter_training_lines(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Yield the non-blank lines of every text, long lines cut to ``max_bytes``."""
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield from split_long_line(line, max_bytes)


def sample_lines(lines: Iterable[str], cap: int, seed: int) -> tuple[list[str], int]:
    """Reservoir-sample at most ``cap`` lines (all when cap is 0); return them and the total."""
    if cap == 0:
        kept = list(lines)
        return kept, len(kept)
    rng = random.Random(seed)
    reservoir: list[str] = []
    total = 0
    for total, line in enumerate(lines, start=1):
        if len(reservoir) < cap:
            reservoir.append(line)
        else:
            slot = rng.randrange(total)
            if slot < cap:
                reservoir[slot] = line
    return reservoir, total


def trainer_options(args: argparse.Namespace) -> dict:
    """SentencePiece trainer options for lossless code/text tokenization."""
    return dict(
        model_prefix=args.model_prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        character_coverage=args.character_coverage,
        num_threads=args.num_threads,
        max_sentence_length=args.max_sentence_length,
        input_sentence_size=0,  # sampling is done here, deterministically
        shuffle_input_sentence=False,
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        normalization_rule_name="identity",
        **SPECIAL_IDS,
    )


def _hint(message: str) -> str:
    """Which of our flags fixes a SentencePiece vocabulary-size error."""
    if "smaller than required_chars" in message:
        return "; raise --vocab-size or lower --character-coverage"
    if "Vocabulary size" in message:
        return "; lower --vocab-size or add more --input text"
    return ""


def train(args: argparse.Namespace, lines: list[str]) -> None:
    """Run the SentencePiece trainer, turning its errors into ones that name our flags."""
    parent = os.path.dirname(os.path.abspath(args.model_prefix))
    os.makedirs(parent, exist_ok=True)
    log = None if args.verbose else open(os.devnull, "w")
    try:
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), logstream=log, **trainer_options(args))
    except RuntimeError as error:
        raise SystemExit(f"tokenizer training failed: {error}{_hint(str(error))}") from error
    finally:
        if log is not None:
            log.close()


def train_bytelevel_bpe(args: argparse.Namespace, texts: Iterable[str]) -> tuple[str, int]:
    """GPT-2's byte-level BPE on whole documents; writes PREFIX/ (vocab.json, merges.txt, tokenizer.json,
    tokenizer_config.json). Returns (the directory, documents read)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=2,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=args.verbose,
    )
    counted = []

    def documents() -> Iterator[str]:
        for text in texts:
            counted.append(None)
            yield text

    tokenizer.train_from_iterator(documents(), trainer=trainer)
    if not counted:
        raise SystemExit(f"--input {' '.join(args.input)}: no text found")
    directory = args.model_prefix
    os.makedirs(directory, exist_ok=True)
    tokenizer.model.save(directory)  # vocab.json, merges.txt ("#version: 0.2" first, as GPT-2's)
    tokenizer.save(os.path.join(directory, "tokenizer.json"), pretty=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": ENDOFTEXT, "add_prefix_space": False}
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as stream:
        json.dump(config, stream, indent=2)
    return directory, len(counted)


def main(argv: list[str] | None = None) -> str:
    """Train the tokenizer; return the path of the written ``.model`` file (bytelevel-bpe: its directory)."""
    args = build_parser().parse_args(argv)
    validate_args(args)
    start = time.time()
    paths = expand_input_paths(args.input, flag="--input")
    texts = (doc[args.json_key] for doc in iter_documents(paths, [args.json_key]))
    if args.model_type == BYTELEVEL:
        directory, documents = train_bytelevel_bpe(args, texts)
        print(
            f"Trained {BYTELEVEL} tokenizer (vocab {args.vocab_size}) on {documents} documents from {len(paths)} "
            f"files in {time.time() - start:.1f}s: {directory}/ (vocab.json, merges.txt, tokenizer.json)",
            file=sys.stderr,
        )
        return directory
    lines, total = sample_lines(
        iter_training_lines(texts, args.max_sentence_length), args.input_sentence_size, args.seed
    )
    if not lines:
        raise SystemExit(f"--input {' '.join(args.input)}: no non-blank text found")
    train(args, lines)
    model_path = args.model_prefix + ".model"
    print(
        f"Trained {args.model_type} tokenizer (vocab {args.vocab_size}) on {len(lines)} of "
        f"{total} lines from {len(paths)} files in {time.time() - start:.1f}s: {model_path}",
        file=sys.stderr,
    )
    return model_path


if __name__ == "__main__":
    try:
        main()
    except DataError as error:
        raise SystemExit(f"error: {error}") from None
