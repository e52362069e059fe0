"""Per-module activation policy: keep, recompute, or keep quantized (Arctic's selective scheme).

In: --activation-policy (a preset: none, full, arctic), --recompute-modules, --quantize-activations; out: one mode
per module name of `MODULES`: `save` (kept as is, the default), `recompute` (its output recomputed from its
inputs in backward), `quantize` (the tensors saved inside it kept compact), or `recompute+quantize` (its input
kept quantized once, for both). Pure configuration (the config layer); `megatron_moe.activations` carries it out.
The modes and presets in full: docs/internals/config.md.
"""

from __future__ import annotations

import dataclasses

from megatron_moe.config.fields import ConfigError, require

QUANT_FORMATS = ("int8_row", "int8_block", "fp8_row")
"""Storage formats of quantized activations (`megatron_moe.activations.quantize` implements them)."""

# name -> (what it is, whether floating-point activations are saved inside it)
MODULES: dict[str, tuple[str, bool]] = {
    "input_norm": ("norm before attention", True),
    "qkv": ("QKV projection GEMM", True),
    "core_attention": ("softmax(QK^T)V", True),
    "attn_proj": ("attention output projection GEMM", True),
    "pre_mlp_norm": ("norm before the MLP / MoE", True),
    "router": ("gate: router GEMM, scores, top-k", True),
    "ordering": ("token -> expert-major scatter", False),
    "dispatch": ("dispatch all-to-all", False),
    "expert_fc1": ("experts' first GEMM", True),
    "expert_act": ("experts' activation function", True),
    "expert_fc2": ("experts' second GEMM", True),
    "combine": ("combine all-to-all", False),
    "unorder": ("expert-major -> token gather, gate weighting", True),
    "shared_expert": ("dense shared expert MLP", True),
    "mlp_fc1": ("dense MLP first GEMM", True),
    "mlp_act": ("dense MLP activation function", True),
    "mlp_fc2": ("dense MLP second GEMM", True),
}

MCORE_MODULES: dict[str, tuple[str, ...]] = {
    "core_attn": ("core_attention",),
    "moe_act": ("expert_act",),
    "layernorm": ("input_norm", "pre_mlp_norm"),
    "mlp": ("mlp_fc1", "mlp_act", "mlp_fc2"),
    "shared_experts": ("shared_expert",),
    "moe": ("router", "expert_fc1", "expert_act", "expert_fc2", "unorder", "shared_expert"),
    "mla_up_proj": ("qkv",),
}
"""megatron-core's --recompute-modules names (TransformerConfig.recompute_modules, 0.16.1) -> ours, where they
recompute the same arithmetic. Where megatron-core checkpoints a block whole, keeping only its input, ours
recompute each of its pieces from its own input: `mlp`; `moe` (every computing piece of the MoE layer; the
all-to-alls' outputs are kept, so no communication repeats); `mla_up_proj` (MLA's projections, the
down-projections included: more recompute than megatron-core's, the same memory kept)."""
MCORE_REFUSED: dict[str, str] = {}
"""megatron-core's names that mean nothing the same here, with why and what to use (none in 0.16.1)."""

PRESETS: dict[str, dict[str, str]] = {
    "none": {},
    # Arctic: recompute the cheap, memory-heavy ops (norms, activation functions) from
    # their quantized inputs; quantize what the GEMMs and attention keep; keep the
    # all-to-all outputs (recomputing those would repeat communication).
    "arctic": {
        **dict.fromkeys(["input_norm", "pre_mlp_norm", "expert_act", "mlp_act"], "recompute+quantize"),
        **dict.fromkeys(
            [
                "qkv",
                "attn_proj",
                "expert_fc1",
                "expert_fc2",
                "mlp_fc1",
                "mlp_fc2",
                "core_attention",
                "shared_expert",
                "unorder",
            ],
            "quantize",
        ),
        **dict.fromkeys(["dispatch", "combine"], "save"),
    },
}


@dataclasses.dataclass(frozen=True)
class ActivationPolicy:
    """The mode of every module, and the quantized format."""

    modes: dict[str, str]
    quant_format: str = "int8_row"
    quant_block: int = 128

    def mode(self, name: str) -> str:
        return self.modes.get(name, "save")

    @property
    def is_trivial(self) -> bool:
        return all(m == "save" for m in self.modes.values())


def _names(flag: str, names: list[str]) -> list[str]:
    """Our module names, megatron-core's mapped onto them (`MCORE_MODULES`); a refused or unknown name by name."""
    ours = []
    for name in names:
        require(name not in MCORE_REFUSED, flag, name, MCORE_REFUSED.get(name, ""))
        if name in MCORE_MODULES:
            ours += [n for n in MCORE_MODULES[name] if n not in ours]
            continue
        require(
            name in MODULES,
            flag,
            name,
            f"a module name, one of: {', '.join(MODULES)}, or megatron-core's {', '.join(MCORE_MODULES)}",
        )
        ours += [] if name in ours else [name]
    return ours


def build_policy(
    *, preset: str, recompute: list[str], quantize: list[str], quant_format: str, quant_block: int = 128
) -> ActivationPolicy:
    """The preset, then per-module overrides from --recompute-modules / --quantize-activations."""
    require(preset in PRESETS, "--activation-policy", preset, f"one of {', '.join([*PRESETS, 'full'])}")
    require(
        quant_format in QUANT_FORMATS, "--activation-quant-format", quant_format, f"one of {', '.join(QUANT_FORMATS)}"
    )
    require(quant_block > 0, "--activation-quant-block", quant_block, "must be positive")
    modes = dict(PRESETS[preset])
    recompute = _names("--recompute-modules", recompute)
    for name in recompute:
        modes[name] = "recompute"
    for name in _names("--quantize-activations", quantize):
        if name in recompute:
            modes[name] = "recompute+quantize"
            continue
        if not MODULES[name][1]:
            raise ConfigError(
                f"--quantize-activations={name}: the {MODULES[name][0]} keeps no floating-point "
                f"activations of its own to quantize; quantize its consumer instead (e.g. expert_fc1 "
                f"for the dispatched tokens) or choose save/recompute"
            )
        modes[name] = "quantize"
    return ActivationPolicy(modes=modes, quant_format=quant_format, quant_block=quant_block)
