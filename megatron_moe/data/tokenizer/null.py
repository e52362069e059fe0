"""Megatron-LM's NullTokenizer: ids are the text's numbers, the vocabulary `--vocab-size` ids, eod the last one.

In: --vocab-size V (and --null-tokenizer-eod-id, default V - 1). Out: a `Tokenizer` whose `tokenize("5 7 9")` is
[5, 7, 9], `vocab_size` V and `eod` V - 1, as Megatron-LM HEAD's `megatron/core/tokenizers/text/libraries/
null_tokenizer.py` (its tests train on --mock-data with it). No file: nothing to hash or export.
"""

from __future__ import annotations

from megatron_moe.data.tokenizer.base import NO_PAD_FALLBACK, Tokenizer


class NullTokenizer(Tokenizer):
    """Ids typed as numbers; `vocab_size` ids, `eod` the last unless given."""

    tokenizer_type = "NullTokenizer"

    def __init__(self, vocab_size: int | str, eod_id: int | str | None = None):
        super().__init__(*(str(v) for v in (vocab_size, eod_id) if v is not None))
        self._vocab_size = int(vocab_size)
        self._eod = self._vocab_size - 1 if eod_id is None else int(eod_id)
        self.files = ()

    @property
    def description(self) -> str:
        return f"NullTokenizer --vocab-size {self._vocab_size} (eod {self._eod})"

    def tokenize(self, text: str) -> list[int]:
        """`"5 7 9"` -> [5, 7, 9]."""
        return [int(word) for word in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(i) for i in self.as_ids(ids))

    @property
    def vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self._vocab_size)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: str(i) for i in range(self._vocab_size)}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        """None defined: the eod, as GPT-2's."""
        return self._eod

    @property
    def pad(self) -> int:
        """`NO_PAD_FALLBACK` (-1), Megatron-LM's NullTokenizer's pad."""
        return NO_PAD_FALLBACK
