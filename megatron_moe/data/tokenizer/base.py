"""What every tokenizer here is: megatron-core's tokenizer interface, named by its files, picklable by them.

megatron-core's ``GPTDataset`` reads ``tokenizer.eod`` (end-of-document id, used for masks), ``tokenizer.pad``
(padding id, masked out of the loss; checked against ``eos``/``eod`` for a collision), ``tokenizer.eos`` and
``tokenizer.vocab_size`` (token dtype); ``tools/preprocess_data.py`` calls ``tokenize`` and appends ``eod``.
"""

from __future__ import annotations

import os
from typing import ClassVar

from megatron.core.datasets.megatron_dataset import _PAD_TOKEN_ID
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

from megatron_moe.data import DataError

NO_PAD_FALLBACK = _PAD_TOKEN_ID
"""``pad`` of a tokenizer without a pad token (or whose pad token is its eod): megatron-core's own sentinel (-1),
an id that never occurs in tokenized data, so GPTDataset masks only the padding it adds itself and never collides
with eos/eod."""


class TokenizerError(DataError):
    """A tokenizer file is missing, unreadable or of the wrong kind for the --tokenizer-type."""


class Tokenizer(MegatronLegacyTokenizer):
    """A tokenizer built from files named by flags (`paths`, as given); re-built from them when unpickled
    (data loader workers, preprocessing workers), since the native tokenizers cannot all be pickled.

    Subclasses define `tokenizer_type` (the --tokenizer-type), `files` (what identifies and describes the
    vocabulary: hashed into the data's sidecar, named in the start-up summary, exported to HuggingFace), and
    megatron-core's abstract `tokenize`, `vocab`, `inv_vocab`, `vocab_size`, plus `eod`, `eos`, `pad`, `bos`.
    """

    tokenizer_type: ClassVar[str]
    files: tuple[str, ...]

    def __init__(self, *paths: str):
        super().__init__(*paths)
        self._paths = paths

    def __getstate__(self) -> dict:
        return {"paths": self._paths}

    def __setstate__(self, state: dict) -> None:
        self.__init__(*state["paths"])

    @property
    def description(self) -> str:
        """``GPT2BPETokenizer data/bpe/vocab.json + data/bpe/merges.txt``: the type and its files."""
        return f"{self.tokenizer_type} {' + '.join(self.files)}"

    @property
    def eos(self) -> int:
        """End-of-sequence id: the end-of-document id (what megatron-core checks ``pad`` against)."""
        return self.eod

    @staticmethod
    def as_ids(ids) -> list[int]:
        """A list of ints from a list, numpy array or tensor of ids."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return [int(i) for i in ids]


def require_file(flag: str, path: str | None, expected: str) -> str:
    """`path`, an existing file, else a TokenizerError naming the flag, the path and what to pass."""
    if not path:
        raise TokenizerError(f"{flag} is empty; pass {expected}")
    if os.path.isdir(path):
        raise TokenizerError(f"{flag} {path!r} is a directory; pass {expected}")
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag} {path!r}: no such file; pass {expected}")
    return path
