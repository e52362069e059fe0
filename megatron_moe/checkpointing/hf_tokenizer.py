"""The tokenizer of a HuggingFace model directory: written on export as the run used it, read back on import.

On export the run's tokenizer goes with the weights, in the files transformers' ``AutoTokenizer`` loads:
- SentencePieceTokenizer: ``tokenizer.model`` and a Llama ``tokenizer_config.json`` (Mixtral's own layout);
- GPT2BPETokenizer: ``vocab.json``, ``merges.txt``, the same BPE as ``tokenizer.json`` and a GPT-2
  ``tokenizer_config.json`` (``<|endoftext|>`` as bos, eos and unk, no prefix space, nothing added);
- HuggingFaceTokenizer: its ``tokenizer.json``, with its ``tokenizer_config.json``/``special_tokens_map.json``
  when it had them, else a ``tokenizer_config.json`` naming its eos/bos/pad tokens.
A directory holding ``tokenizer.model`` reads back as SentencePieceTokenizer, else one holding ``tokenizer.json``
as HuggingFaceTokenizer (a GPT-2 export gives the same ids either way).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

from megatron_moe.config import ConfigError, DataConfig
from megatron_moe.data.tokenizer import GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, Tokenizer
from megatron_moe.data.tokenizer.huggingface import ENDOFTEXT

LLAMA_TOKENIZER_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": "<pad>",
    "add_bos_token": False,
    "add_eos_token": False,
    "add_prefix_space": False,
    "legacy": False,
}
GPT2_TOKENIZER_CONFIG = {
    "tokenizer_class": "GPT2Tokenizer",
    "bos_token": ENDOFTEXT,
    "eos_token": ENDOFTEXT,
    "unk_token": ENDOFTEXT,
    "add_bos_token": False,
    "add_prefix_space": False,
}


def write_hf_tokenizer(tokenizer: Tokenizer, directory: str) -> list[str]:
    """Write `tokenizer`'s files for transformers into `directory`; returns the names written."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        shutil.copyfile(tokenizer.model_path, os.path.join(directory, "tokenizer.model"))
        return ["tokenizer.model", _write_json(directory, "tokenizer_config.json", LLAMA_TOKENIZER_CONFIG)]
    if isinstance(tokenizer, GPT2BPETokenizer):
        for path, name in zip(tokenizer.files, ("vocab.json", "merges.txt")):
            shutil.copyfile(path, os.path.join(directory, name))
        with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as stream:
            stream.write(tokenizer.to_hf_json())
        config = _write_json(directory, "tokenizer_config.json", GPT2_TOKENIZER_CONFIG)
        return ["vocab.json", "merges.txt", "tokenizer.json", config]
    if isinstance(tokenizer, HuggingFaceTokenizer):
        shutil.copyfile(tokenizer.files[0], os.path.join(directory, "tokenizer.json"))
        for path in tokenizer.config_files:
            shutil.copyfile(path, os.path.join(directory, os.path.basename(path)))
        written = ["tokenizer.json", *(os.path.basename(path) for path in tokenizer.config_files)]
        if "tokenizer_config.json" not in written:
            written.append(_write_json(directory, "tokenizer_config.json", _hf_tokenizer_config(tokenizer)))
        return written
    raise ConfigError(f"--tokenizer-type {tokenizer.tokenizer_type}: no HuggingFace export for it")


def _hf_tokenizer_config(tokenizer: HuggingFaceTokenizer) -> dict:
    """transformers' fast tokenizer over tokenizer.json, with the special tokens this run used."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.inv_vocab[tokenizer.eod]}
    if tokenizer.bos >= 0:
        config["bos_token"] = tokenizer.inv_vocab[tokenizer.bos]
    if tokenizer.pad >= 0:
        config["pad_token"] = tokenizer.inv_vocab[tokenizer.pad]
    return config


def _write_json(directory: str, name: str, value: dict) -> str:
    with open(os.path.join(directory, name), "w", encoding="utf-8") as stream:
        json.dump(value, stream, indent=2)
    return name


def tokenizer_flags_of(path: str, data: DataConfig, flag: str = "--tokenizer-model") -> DataConfig:
    """`data` with the tokenizer that `path` holds: a SentencePiece ``.model``, a tokenizer.json, or a directory
    holding either (a HuggingFace model directory; tokenizer.model first, as transformers' Llama prefers it)."""
    if os.path.isdir(path):
        for name, kind in (("tokenizer.model", "SentencePieceTokenizer"), ("tokenizer.json", "HuggingFaceTokenizer")):
            if os.path.isfile(os.path.join(path, name)):
                return _with_tokenizer(data, kind, os.path.join(path, name) if name == "tokenizer.model" else path)
        raise ConfigError(f"{flag}={path}: holds neither tokenizer.model (sentencepiece) nor tokenizer.json")
    kind = "HuggingFaceTokenizer" if path.endswith(".json") else "SentencePieceTokenizer"
    return _with_tokenizer(data, kind, path)


def _with_tokenizer(data: DataConfig, kind: str, path: str) -> DataConfig:
    return dataclasses.replace(data, tokenizer_type=kind, tokenizer_model=path, vocab_file=None, merge_file=None)
