"""The token's path through the MoE layer (issue 39's target). The package-wide rules (no private cross-module
import, files under 500 lines, docstrings as contracts) are tests/unit/test_house_rules.py's."""


def test_a_token_reaches_the_expert_gemm_and_comes_back_through_at_most_8_files_and_20_frames():
    """tools/layer_path.py on the demo's layer in one process: the files and frames on the stacks at the expert
    GEMMs (forward and backward), and the deepest stack of our frames anywhere in the layer. (EP = 2, with the
    row all-to-alls: `torchrun --nproc-per-node 2 -m tools.layer_path`, moe/README.md.)"""
    import torch

    from tools.layer_path import build_layer, measure

    torch.manual_seed(0)
    x = torch.randn(64, 1, 256, requires_grad=True)
    forward, backward, both = measure(build_layer(1), x, 1)
    assert forward["at_gemm"] > 0 and backward["at_gemm"] > 0  # the recorder saw the expert GEMMs
    assert both["path_files"] <= 8, both["path_file_list"]
    assert both["path_frames"] <= 20, both["path_frame_list"]
    assert both["deepest"] <= 20
