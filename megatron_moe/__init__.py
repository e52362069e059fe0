"""megatron_moe: Mixture-of-Experts pretraining on megatron-core (README.md).

Importing the package imports nothing heavy: it only arranges that megatron-core's fused functions compile on
their first call rather than when megatron-core loads (`import_hooks`).
"""

from megatron_moe.import_hooks import defer_megatron_core_compiles

defer_megatron_core_compiles()
