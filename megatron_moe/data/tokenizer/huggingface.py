"""GPT2BPETokenizer and HuggingFaceTokenizer, both on HuggingFace's `tokenizers` library.

GPT2BPETokenizer (``--vocab-file vocab.json --merge-file merges.txt``) is Megatron-LM's GPT-2 byte-level BPE;
end of document ``<|endoftext|>``, which in the text is ordinary text: only ``--append-eod`` puts the eod id in.
HuggingFaceTokenizer (``--tokenizer-model DIR`` holding ``tokenizer.json``, or that file) runs tokenizer.json as
transformers' fast tokenizer would (normalizer, pre-tokenizer, model, post-processor; added special tokens split
out); special tokens come from ``tokenizer_config.json`` beside it, else from the vocabulary (``EOD_TOKENS``,
``BOS_TOKENS``, ``PAD_TOKENS``).
Invariant: neither pads with a real id unless the tokenizer defines a pad token other than its eod: ``pad`` is
then ``NO_PAD_FALLBACK`` (-1), megatron-core's sentinel. The details: docs/internals/data.md.
"""

from __future__ import annotations

import json
import os
from functools import cached_property

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as NativeTokenizer

from megatron_moe.data.tokenizer.base import NO_PAD_FALLBACK, Tokenizer, TokenizerError, require_file

ENDOFTEXT = "<|endoftext|>"
"""GPT-2's end of document (and its bos and unk in transformers' GPT-2 tokenizer)."""
EOD_TOKENS = (ENDOFTEXT, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
BOS_TOKENS = ("<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>")
PAD_TOKENS = ("<pad>", "<|pad|>", "[PAD]")
TRAINED_BY = "tools/train_tokenizer.py --model-type bytelevel-bpe"
VOCAB_EXPECTED = f"GPT-2's vocab.json, a JSON object token -> id (written with merges.txt by {TRAINED_BY})"
MERGES_EXPECTED = f"GPT-2's merges.txt, '#version: 0.2' then one 'left right' pair per line (by {TRAINED_BY})"
HF_EXPECTED = f"a directory holding tokenizer.json, or that file (e.g. the directory {TRAINED_BY} writes)"


def gpt2_native_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> NativeTokenizer:
    """GPT-2's byte-level BPE over `vocab` and `merges`, as the `tokenizers` library runs it."""
    tokenizer = NativeTokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def read_gpt2_vocab(path: str) -> dict[str, int]:
    """vocab.json's token -> id, with errors naming --vocab-file, the path and what it should hold."""
    require_file("--vocab-file", path, VOCAB_EXPECTED)
    try:
        with open(path, encoding="utf-8") as stream:
            vocab = json.load(stream)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerError(f"--vocab-file {path!r} is not JSON ({error}); pass {VOCAB_EXPECTED}") from error
    if not isinstance(vocab, dict) or not vocab or not all(type(i) is int and i >= 0 for i in vocab.values()):
        hint = "; a tokenizer.json goes with --tokenizer-type HuggingFaceTokenizer" if "model" in vocab else ""
        raise TokenizerError(f"--vocab-file {path!r} does not map tokens to ids{hint}; pass {VOCAB_EXPECTED}")
    if ENDOFTEXT not in vocab:
        raise TokenizerError(
            f"--vocab-file {path!r} has no {ENDOFTEXT} token, GPT-2's end of document; pass {VOCAB_EXPECTED}"
        )
    return vocab


def read_gpt2_merges(path: str) -> list[tuple[str, str]]:
    """merges.txt's pairs in rank order, with errors naming --merge-file, the path and the bad line."""
    require_file("--merge-file", path, MERGES_EXPECTED)
    try:
        with open(path, encoding="utf-8") as stream:
            lines = stream.read().split("\n")
    except UnicodeDecodeError as error:
        raise TokenizerError(f"--merge-file {path!r} is not UTF-8 text ({error}); pass {MERGES_EXPECTED}") from error
    merges = []
    for number, line in enumerate(lines, start=1):
        if not line or (number == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2 or not all(pair):
            raise TokenizerError(
                f"--merge-file {path!r} line {number} is {line[:60]!r}, not a 'left right' pair; pass {MERGES_EXPECTED}"
            )
        merges.append((pair[0], pair[1]))
    return merges


class NativeTokenizerMixin:
    """What both tokenizers do with a `tokenizers.Tokenizer` in `self._native`."""

    _native: NativeTokenizer

    def detokenize(self, ids) -> str:
        """Token ids (list, numpy array or tensor) back to text; special tokens kept, as Megatron-LM does."""
        return self._native.decode(Tokenizer.as_ids(ids), skip_special_tokens=False)

    @cached_property
    def vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included."""
        return self._native.get_vocab(with_added_tokens=True)

    @cached_property
    def inv_vocab(self) -> dict[int, str]:
        """Id -> token."""
        return {i: token for token, i in self.vocab.items()}

    @cached_property
    def vocab_size(self) -> int:
        """Largest id + 1: every id the tokenizer can produce is below it (= the number of tokens when the ids
        are contiguous, as in GPT-2's vocab.json and any tokenizer the `tokenizers` library trains)."""
        return max(self.vocab.values()) + 1


class GPT2BPETokenizer(NativeTokenizerMixin, Tokenizer):
    """Megatron-LM's GPT2BPETokenizer (see the module docstring).

    Args:
        vocab_file: vocab.json (``--vocab-file``).
        merge_file: merges.txt (``--merge-file``).
    """

    tokenizer_type = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        vocab, merges = read_gpt2_vocab(vocab_file), read_gpt2_merges(merge_file)
        try:
            native = gpt2_native_tokenizer(vocab, merges)
        except Exception as error:  # the Rust side's own exception type: a merge naming a token not in the vocab
            raise TokenizerError(
                f"--vocab-file {vocab_file!r} and --merge-file {merge_file!r} do not belong together ({error}); "
                f"pass the vocab.json and merges.txt written together (by {TRAINED_BY})"
            ) from error
        super().__init__(vocab_file, merge_file)
        self.files = (vocab_file, merge_file)
        self._native = native
        self._eod = vocab[ENDOFTEXT]

    def tokenize(self, text: str) -> list[int]:
        """Text to ids (nothing added)."""
        return self._native.encode(text, add_special_tokens=False).ids

    @property
    def eod(self) -> int:
        """The id of ``<|endoftext|>``."""
        return self._eod

    @property
    def bos(self) -> int:
        """``<|endoftext|>`` as well: GPT-2 has no other (transformers' GPT-2 config says the same)."""
        return self._eod

    @property
    def pad(self) -> int:
        """``NO_PAD_FALLBACK`` (-1): GPT-2 defines no pad token."""
        return NO_PAD_FALLBACK

    def to_hf_json(self) -> str:
        """transformers' tokenizer.json of this tokenizer: the same BPE, with ``<|endoftext|>`` an added special
        token as in GPT-2's own tokenizer.json (transformers then splits it out of text; we read it as text)."""
        native = NativeTokenizer.from_str(self._native.to_str())
        native.add_special_tokens([AddedToken(ENDOFTEXT, special=True, normalized=False)])
        return native.to_str(pretty=True)


def locate_tokenizer_json(path: str) -> str:
    """The tokenizer.json that ``--tokenizer-model PATH`` names: PATH/tokenizer.json, or PATH itself."""
    flag = "--tokenizer-model"
    if not path:
        raise TokenizerError(f"{flag} is empty; pass {HF_EXPECTED}")
    if os.path.isdir(path):
        found = os.path.join(path, "tokenizer.json")
        if os.path.isfile(found):
            return found
        gpt2 = os.path.isfile(os.path.join(path, "vocab.json")) and os.path.isfile(os.path.join(path, "merges.txt"))
        hint = "; its vocab.json and merges.txt go with --tokenizer-type GPT2BPETokenizer" if gpt2 else ""
        raise TokenizerError(f"{flag} {path!r} holds no tokenizer.json{hint}; pass {HF_EXPECTED}")
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag} {path!r}: no such file or directory; pass {HF_EXPECTED}")
    if path.endswith(".model"):
        raise TokenizerError(
            f"{flag} {path!r} looks like a SentencePiece model: pass --tokenizer-type SentencePieceTokenizer for "
            f"it, or {HF_EXPECTED}"
        )
    return path


def _token_text(value) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken's {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class HuggingFaceTokenizer(NativeTokenizerMixin, Tokenizer):
    """A HuggingFace tokenizer.json (see the module docstring).

    Args:
        path: ``--tokenizer-model``: a directory holding tokenizer.json (and perhaps tokenizer_config.json),
            or a tokenizer.json file.
    """

    tokenizer_type = "HuggingFaceTokenizer"

    def __init__(self, path: str):
        json_path = locate_tokenizer_json(path)
        try:
            native = NativeTokenizer.from_file(json_path)
        except Exception as error:  # the Rust side's own exception type
            raise TokenizerError(
                f"--tokenizer-model {path!r}: {json_path} is not a HuggingFace tokenizer.json ({error}); "
                f"pass {HF_EXPECTED}"
            ) from error
        super().__init__(path)
        self.files = (json_path,)
        self._native = native
        self.config_files = tuple(
            found
            for name in ("tokenizer_config.json", "special_tokens_map.json")
            if os.path.isfile(found := os.path.join(os.path.dirname(json_path), name))
        )
        self.special = self._special_tokens()
        if self.special["eos"] is None:
            raise TokenizerError(
                f"--tokenizer-model {path!r} defines no end-of-document token: no eos_token in a "
                f"tokenizer_config.json beside {os.path.basename(json_path)}, and none of "
                f"{', '.join(EOD_TOKENS)} in its vocabulary; add one (e.g. train with {TRAINED_BY}, which adds "
                f"{ENDOFTEXT})"
            )

    def _special_tokens(self) -> dict[str, int | None]:
        """{"eos", "bos", "pad"}: ids from tokenizer_config.json's *_token where given, else the first of the
        usual names in the vocabulary; None where neither has one."""
        config = {}
        for path in self.config_files:
            with open(path, encoding="utf-8") as stream:
                config = {**json.load(stream), **config}  # tokenizer_config.json wins
        found = {}
        for role, names in (("eos", EOD_TOKENS), ("bos", BOS_TOKENS), ("pad", PAD_TOKENS)):
            named = _token_text(config.get(f"{role}_token"))
            candidates = [named] if named else list(names)
            found[role] = next((self.vocab[t] for t in candidates if t in self.vocab), None)
        return found

    def tokenize(self, text: str) -> list[int]:
        """Text to ids, with what the tokenizer's post-processor adds (e.g. a BOS), as Megatron-LM's does."""
        return self._native.encode(text).ids

    @property
    def eod(self) -> int:
        """The end-of-document id: tokenizer_config.json's eos_token, else the first of ``EOD_TOKENS``."""
        return self.special["eos"]

    @property
    def bos(self) -> int:
        """tokenizer_config.json's bos_token, else the first of ``BOS_TOKENS``; -1 when there is none."""
        return -1 if self.special["bos"] is None else self.special["bos"]

    @property
    def pad(self) -> int:
        """tokenizer_config.json's pad_token, else the first of ``PAD_TOKENS``; ``NO_PAD_FALLBACK`` (-1) when
        there is none or it is the eod (megatron-core would refuse to mask it)."""
        pad = self.special["pad"]
        return NO_PAD_FALLBACK if pad is None or pad == self.eod else pad
