"""HuggingFace families into and out of a parallel layout (issue 42): `import-hf` straight into TP=2 + PP=2 + EP=2
(4 ranks: the experts' EP group spans the TP ranks) through `reshard`, its logit check against transformers, then
`export-hf` from that layout: every HF tensor comes back bit for bit, DeepSeek-V3's MLA, expert correction bias and
MTP layer and Qwen2-MoE's QKV bias and gated shared expert included."""

import pytest
import torch

from tests.unit.test_hf_families import add_an_mtp_layer, hf_tensors, random_hf

pytest.importorskip("transformers")
LAYOUT = ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]
LAYOUT += ["--target-expert-parallel-size", "2"]


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen2_moe"])
def test_a_family_imports_into_tp2_pp2_ep2_and_exports_from_it_bit_for_bit(
    megatron_world1, bytelevel_dir, tmp_path, model_type, capsys
):
    from megatron.core import dist_checkpointing

    from tools.checkpoint import convert

    hf_dir, ckpt, back = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "back")
    random_hf(model_type, bytelevel_dir, hf_dir, num_hidden_layers=4, mlp_only_layers=[2])
    tensors = add_an_mtp_layer(hf_dir) if model_type == "deepseek_v3" else hf_tensors(hf_dir)
    assert convert.main(["import-hf", "--load", hf_dir, "--save", ckpt, *LAYOUT]) == 0
    out = capsys.readouterr().out
    assert "import-hf: resharding to TP=2" in out and "verify: max |logits" in out, out
    layout = dist_checkpointing.load_common_state_dict(f"{ckpt}/iter_0000000")["layout"]
    assert (layout["tp"], layout["pp"], layout["ep"]) == (2, 2, 2), layout
    assert convert.main(["export-hf", "--load", ckpt, "--save", back]) == 0
    again = hf_tensors(back)
    assert sorted(again) == sorted(tensors)
    assert [name for name in tensors if not torch.equal(tensors[name], again[name])] == []
