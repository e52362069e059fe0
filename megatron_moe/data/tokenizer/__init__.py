"""The tokenizers megatron-core's GPT datasets and tools/preprocess_data.py use, by Megatron-LM's --tokenizer-type.

- ``SentencePieceTokenizer``: ``--tokenizer-model`` a SentencePiece ``.model`` (``sentencepiece_model.py``);
- ``GPT2BPETokenizer``: ``--vocab-file vocab.json --merge-file merges.txt``, GPT-2's byte-level BPE;
- ``HuggingFaceTokenizer``: ``--tokenizer-model`` a directory holding ``tokenizer.json``, or that file
  (both on HuggingFace's ``tokenizers`` library, ``huggingface.py``);
- ``NullTokenizer``: ``--vocab-size V``, ids typed as numbers, eod V - 1 (``null.py``; with ``--mock-data``).

`build_tokenizer(data_config)` is the one place a tokenizer is made from the flags: training, preprocessing and
the HuggingFace export call it. Every tokenizer has the interface of ``base.Tokenizer``.
"""

from __future__ import annotations

from megatron_moe.config import TOKENIZER_TYPES, DataConfig, rules_groups
from megatron_moe.data.tokenizer.base import NO_PAD_FALLBACK, Tokenizer, TokenizerError
from megatron_moe.data.tokenizer.huggingface import GPT2BPETokenizer, HuggingFaceTokenizer
from megatron_moe.data.tokenizer.null import NullTokenizer
from megatron_moe.data.tokenizer.sentencepiece_model import SentencePieceTokenizer, load_sentencepiece_model

TOKENIZERS: dict[str, type[Tokenizer]] = {
    cls.tokenizer_type: cls for cls in (SentencePieceTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer)
}
assert tuple(TOKENIZERS) == TOKENIZER_TYPES, "the config's --tokenizer-type choices are the tokenizers built here"


def build_tokenizer(data: DataConfig) -> Tokenizer:
    """The tokenizer the data flags name (--tokenizer-type and its files); a TokenizerError names the flag, the
    path and what it should hold when a file is missing or of the wrong kind."""
    rules_groups.check_tokenizer(data)
    if data.tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(data.vocab_file, data.merge_file)
    if data.tokenizer_type == "NullTokenizer":
        return NullTokenizer(data.vocab_size, data.null_tokenizer_eod_id)
    return TOKENIZERS[data.tokenizer_type](data.tokenizer_model)


__all__ = [
    "NO_PAD_FALLBACK",
    "TOKENIZERS",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TokenizerError",
    "build_tokenizer",
    "load_sentencepiece_model",
]
