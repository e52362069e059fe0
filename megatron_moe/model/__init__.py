"""GPT mixture-of-experts model built from megatron-core GPTModel and our layer spec."""

from megatron_moe.model.builder import build_model, padded_vocab_size, run_fusions, transformer_config

__all__ = ["build_model", "padded_vocab_size", "run_fusions", "transformer_config"]
