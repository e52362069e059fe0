"""Communication hidden under computation: Lancet's weight-gradient GEMMs under the backward all-to-alls."""

from megatron_moe.overlap.install import install_on_moe_layer, install_wgrad_overlap
from megatron_moe.overlap.runtime import WgradQueue

__all__ = ["WgradQueue", "install_on_moe_layer", "install_wgrad_overlap"]
