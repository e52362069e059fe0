"""megatron-core's fused kernels for this run: on where the platform has them and the run's settings allow them.

The platform says which kernels exist (`megatron_moe.platform.fusions.fused_kernels`); this module adds what
megatron-core 0.16.1 validates or silently needs of the settings, the run's `--no-*-fusion` flags (Megatron-LM's
names), and what this stack's own features need (Lancet's deferred weight gradients, the activation policy's
`mlp_act` region). Each fusion off carries its reason, for the start-up summary.
"""

from __future__ import annotations

import dataclasses

from megatron_moe.config import RunConfig
from megatron_moe.model.attention import mla_fused_rope
from megatron_moe.platform.fusions import MISSING, FusedKernels

LABELS = {
    "bias_activation": "bias+activation",
    "bias_dropout": "bias+dropout+add",
    "masked_softmax": "masked softmax",
    "rope": "RoPE",
    "gradient_accumulation": "gradient accumulation",
}
NO_ACCELERATOR = MISSING["accelerator"]


@dataclasses.dataclass(frozen=True)
class Fusions:
    """Each fusion on or off; `off` names why each one is off."""

    bias_activation: bool
    bias_dropout: bool
    masked_softmax: bool
    rope: bool
    gradient_accumulation: bool
    off: dict[str, str] = dataclasses.field(default_factory=dict)

    def transformer_config_kwargs(self) -> dict[str, bool]:
        """The TransformerConfig fields (persist_layer_norm only picks apex's FusedLayerNorm, never built here)."""
        return dict(
            bias_activation_fusion=self.bias_activation,
            bias_dropout_fusion=self.bias_dropout,
            masked_softmax_fusion=self.masked_softmax,
            apply_rope_fusion=self.rope,
            gradient_accumulation_fusion=self.gradient_accumulation,
            persist_layer_norm=False,
        )

    def on(self) -> list[str]:
        return [LABELS[name] for name in LABELS if getattr(self, name)]

    def describe(self) -> str:
        """E.g. `on: bias+activation, RoPE; off: masked softmax (--no-masked-softmax-fusion), ...`."""
        off = [f"{LABELS[name]} ({why})" for name, why in self.off.items()]
        return f"on: {', '.join(self.on()) or 'none'}; off: {', '.join(off) or 'none'}"


def _first_failing(checks: list[tuple[bool, str]]) -> str | None:
    """The reason of the first check that fails (None: all pass, the fusion is on)."""
    return next((why for ok, why in checks if not ok), None)


def choose_fusions(cfg: RunConfig, kernels: FusedKernels, *, transformer_engine: bool) -> Fusions:
    """The fusions of this run on this platform (`transformer_engine`: the layers are transformer-engine's)."""
    m, t = cfg.model, cfg.training
    gpu = kernels.accelerator
    swiglu = m.swiglu
    policy = cfg.activation_policy()
    mcore_mlp = not cfg.moe.own_layer or 0 in cfg.moe.layer_pattern(m.num_layers)
    mcore_moe = cfg.moe.is_moe and not cfg.moe.own_layer
    checks = {
        "bias_activation": [
            (
                not (m.no_bias_swiglu_fusion if swiglu else m.no_bias_gelu_fusion),
                f"--no-bias-{'swiglu' if swiglu else 'gelu'}-fusion",
            ),
            (gpu, NO_ACCELERATOR),
            (mcore_mlp, "no megatron-core MLP: our MoE layer in every layer"),
            (swiglu or not m.disable_bias_linear, "GELU without biases: megatron-core fuses GELU with its bias only"),
            (
                swiglu or not mcore_moe,
                "GELU experts of megatron-core's MoE layer: it fuses SwiGLU only with the router's probabilities",
            ),
            (
                policy is None or policy.mode("mlp_act") == "save",
                "the activation policy acts on mlp_act, which the fused kernel would bypass",
            ),
        ],
        "bias_dropout": [(not m.no_bias_dropout_fusion, "--no-bias-dropout-fusion"), (gpu, NO_ACCELERATOR)],
        "masked_softmax": [
            (not m.no_masked_softmax_fusion, "--no-masked-softmax-fusion"),
            (gpu, NO_ACCELERATOR),
            (not transformer_engine, "transformer-engine's attention has its own softmax"),
            (t.bf16 or t.fp16, "fp32: the kernel takes bf16/fp16 scores only"),
            (kernels.masked_softmax, MISSING["masked_softmax"]),
        ],
        "rope": [
            (m.position_embedding_type == "rope", "learned positions"),
            (not m.no_rope_fusion, "--no-rope-fusion"),
            (gpu, NO_ACCELERATOR),
            (kernels.rope, MISSING["rope"]),
            (not m.multi_latent_attention or m.mla_rope_type == "yarn", "MLA's fused RoPE is YaRN's only"),
            (not m.multi_latent_attention or mla_fused_rope(), "no fused MLA YaRN kernel (megatron-core's triton)"),
        ],
        "gradient_accumulation": [
            (not m.no_gradient_accumulation_fusion, "--no-gradient-accumulation-fusion"),
            (gpu, NO_ACCELERATOR),
            (
                cfg.moe.wgrad_policy(cfg.parallel.expert_model_parallel_size) == "off",
                "--overlap-wgrad defers weight gradients",
            ),
            (kernels.grad_accum, MISSING["grad_accum"]),
        ],
    }
    off = {name: why for name, c in checks.items() if (why := _first_failing(c)) is not None}
    return Fusions(**{name: name not in off for name in checks}, off=off)
