"""SentencePiece tokenizer with the interface megatron-core's GPT datasets expect.

megatron-core's ``GPTDataset`` reads ``tokenizer.eod`` (end-of-document id, used for
masks), ``tokenizer.pad`` (padding id, masked out of the loss), ``tokenizer.eos`` (checked
for a collision with ``pad``) and ``tokenizer.vocab_size`` (token dtype). Models trained by
``tools/train_tokenizer.py`` define unk/bos/eos/pad pieces, so every id here is a real id
of the vocabulary.
"""

import os
from functools import cached_property

import sentencepiece
from megatron.core.datasets.megatron_dataset import _PAD_TOKEN_ID
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

from megatron_moe.data import DataError

TOKENIZER_FLAG = "--tokenizer-model"

NO_PAD_FALLBACK = _PAD_TOKEN_ID
"""``pad`` of a model without a pad piece: megatron-core's own sentinel (-1), an id that
never occurs in tokenized data, so GPTDataset masks only the padding it adds itself."""


class TokenizerError(DataError):
    """The tokenizer model file is missing, unreadable or unusable."""


def load_sentencepiece_model(model_path: str) -> sentencepiece.SentencePieceProcessor:
    """Load a SentencePiece model, with errors that name ``--tokenizer-model`` and the path."""
    if not model_path:
        raise TokenizerError(f"{TOKENIZER_FLAG} is empty; pass the .model file written by tools/train_tokenizer.py")
    if not os.path.isfile(model_path):
        raise TokenizerError(
            f"{TOKENIZER_FLAG} {model_path!r}: no such file; pass the .model file written by "
            f"tools/train_tokenizer.py (e.g. {TOKENIZER_FLAG} data/tokenizer.model)"
        )
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(model_file=model_path)
    except (OSError, RuntimeError) as error:
        raise TokenizerError(
            f"{TOKENIZER_FLAG} {model_path!r} is not a valid SentencePiece model ({error}); "
            f"re-create it with tools/train_tokenizer.py"
        ) from error
    return processor


class SentencePieceTokenizer(MegatronLegacyTokenizer):
    """A SentencePiece model wrapped for megatron-core datasets and our preprocessing.

    Args:
        model_path: path of the ``.model`` file (the value of ``--tokenizer-model``).
    """

    def __init__(self, model_path: str):
        processor = load_sentencepiece_model(model_path)
        super().__init__(model_path)
        self.model_path = model_path
        self._processor = processor
        if processor.eos_id() < 0:
            raise TokenizerError(
                f"{TOKENIZER_FLAG} {model_path!r} defines no end-of-sequence piece, which "
                f"marks document ends (eod); train one with tools/train_tokenizer.py"
            )

    def __getstate__(self) -> dict:
        """Pickle the model by path; the SWIG processor itself cannot be pickled."""
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        """Re-load the model from its path when unpickled (e.g. in data loader workers)."""
        self.__init__(state["model_path"])

    def tokenize(self, text: str) -> list[int]:
        """Convert text to a list of token ids (no bos/eos added)."""
        return self._processor.EncodeAsIds(text)

    def detokenize(self, ids) -> str:
        """Convert token ids (list, numpy array or tensor) back to text."""
        if hasattr(ids, "tolist"):  # numpy array or torch tensor
            ids = ids.tolist()
        return self._processor.DecodeIds([int(i) for i in ids])

    @cached_property
    def vocab(self) -> dict[str, int]:
        """Mapping from piece text to id."""
        return {self._processor.IdToPiece(i): i for i in range(self.vocab_size)}

    @cached_property
    def inv_vocab(self) -> dict[int, str]:
        """Mapping from id to piece text."""
        return {i: self._processor.IdToPiece(i) for i in range(self.vocab_size)}

    @property
    def vocab_size(self) -> int:
        """Number of pieces in the model (ids are ``0 .. vocab_size - 1``)."""
        return self._processor.GetPieceSize()

    @property
    def eod(self) -> int:
        """End-of-document id appended by ``preprocess_data.py --append-eod`` (= eos)."""
        return self._processor.eos_id()

    @property
    def eos(self) -> int:
        """End-of-sequence id."""
        return self._processor.eos_id()

    @property
    def bos(self) -> int:
        """Beginning-of-sequence id, or -1 when the model defines none."""
        return self._processor.bos_id()

    @property
    def unk(self) -> int:
        """Unknown-piece id."""
        return self._processor.unk_id()

    @property
    def pad(self) -> int:
        """Padding id: the model's pad piece, else ``NO_PAD_FALLBACK`` (-1, see above)."""
        pad_id = self._processor.pad_id()
        return pad_id if pad_id >= 0 else NO_PAD_FALLBACK
