"""SentencePieceTokenizer: a SentencePiece ``.model`` (``--tokenizer-model``).

Models trained by ``tools/train_tokenizer.py`` define unk/bos/eos/pad pieces, so every id here is a real id of
the vocabulary; a model without a pad piece pads with ``NO_PAD_FALLBACK``.
"""

import os
from functools import cached_property

import sentencepiece

from megatron_moe.data.tokenizer.base import NO_PAD_FALLBACK, Tokenizer, TokenizerError

TOKENIZER_FLAG = "--tokenizer-model"


def load_sentencepiece_model(model_path: str) -> sentencepiece.SentencePieceProcessor:
    """Load a SentencePiece model, with errors that name ``--tokenizer-model`` and the path."""
    if not model_path:
        raise TokenizerError(f"{TOKENIZER_FLAG} is empty; pass the .model file written by tools/train_tokenizer.py")
    if os.path.isdir(model_path) or model_path.endswith(".json"):
        raise TokenizerError(
            f"{TOKENIZER_FLAG} {model_path!r} is not a SentencePiece .model; for a HuggingFace tokenizer.json "
            f"(or its directory) pass --tokenizer-type HuggingFaceTokenizer"
        )
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


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model wrapped for megatron-core datasets and our preprocessing.

    Args:
        model_path: path of the ``.model`` file (the value of ``--tokenizer-model``).
    """

    tokenizer_type = "SentencePieceTokenizer"

    def __init__(self, model_path: str):
        processor = load_sentencepiece_model(model_path)
        super().__init__(model_path)
        self.model_path = model_path
        self.files = (model_path,)
        self._processor = processor
        if processor.eos_id() < 0:
            raise TokenizerError(
                f"{TOKENIZER_FLAG} {model_path!r} defines no end-of-sequence piece, which "
                f"marks document ends (eod); train one with tools/train_tokenizer.py"
            )

    def tokenize(self, text: str) -> list[int]:
        """Convert text to a list of token ids (no bos/eos added)."""
        return self._processor.EncodeAsIds(text)

    def detokenize(self, ids) -> str:
        """Convert token ids (list, numpy array or tensor) back to text."""
        return self._processor.DecodeIds(self.as_ids(ids))

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
