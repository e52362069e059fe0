"""HuggingFace import and export of Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3 (issue 42), against
transformers' own classes built from its config classes (no download): `import-hf` and `export-hf` as a user runs
them (their logit check included), our logits within 1e-4 of transformers' (fp32), greedy generation token for
token, and HF -> ours -> HF bit-identical in every tensor. Each tiny model has what its family has: Qwen2's gated
shared expert, QKV bias and a dense layer (mlp_only_layers); Qwen3's query/key norms and heads wider than
hidden / heads; DeepSeek's MLA (V3 with a query LoRA, V2-Lite without), YaRN, dense first layer, shared experts,
V3's sigmoid routing with its correction bias, groups and routed scaling factor; a byte-level BPE tokenizer.json."""

import glob
import json
import os

import pytest
import torch

from megatron_moe.checkpointing import hf_families
from megatron_moe.checkpointing.hf_convert import load_single, max_logit_difference, probe_tokens
from megatron_moe.config import parse_args
from tests.conftest import preprocess_tool
from tests.unit.test_hf_mixtral import TOLERANCE, _greedy

transformers = pytest.importorskip("transformers")
YARN = {"rope_type": "yarn", "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
FAMILIES = {
    "qwen2_moe": dict(
        num_hidden_layers=3, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
        shared_expert_intermediate_size=24, norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        num_hidden_layers=2, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, rope_theta=1e6,
    ),
    "deepseek_v2": dict(
        num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
        q_lora_rank=None, **MLA, rope_scaling=YARN | {"factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707},
    ),
    "deepseek_v3": dict(
        num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=24, **MLA, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        rope_scaling=YARN | {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
}  # fmt: skip
SIZES = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4)


def random_hf(model_type: str, tokenizer_dir: str, directory: str, **changes):
    """transformers' model of `model_type` (tiny, seeded; `changes` to its FAMILIES entry), saved as save_pretrained
    writes it, with the byte-level BPE's tokenizer.json; norms and the correction bias away from their initial 1
    and 0, so a swap would show."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    fields = SIZES | FAMILIES[model_type] | changes
    config = transformers.AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **fields)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                tensor.uniform_(0.5, 1.5)
            elif "e_score_correction_bias" in name:
                tensor.uniform_(-0.1, 0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def hf_tensors(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


def add_an_mtp_layer(hf_dir: str) -> dict[str, torch.Tensor]:
    """`hf_dir`'s DeepSeek-V3 safetensors rewritten with one MTP layer as DeepSeek publishes it, after the
    decoder's (random weights: a layer of the last one's kind, enorm, hnorm, eh_proj, shared_head; copies of the
    embedding and head); returns every tensor now there."""
    from safetensors.torch import save_file

    tensors = hf_tensors(hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    generator = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.startswith(last)]:
        tensors[mtp + name.removeprefix(last)] = torch.rand(tensors[name].shape, generator=generator) + 0.5
    hidden = SIZES["hidden_size"]
    for name, shape in [("enorm", [hidden]), ("hnorm", [hidden]), ("eh_proj", [hidden, 2 * hidden])]:
        tensors[f"{mtp}{name}.weight"] = torch.rand(shape, generator=generator)
    tensors[f"{mtp}shared_head.norm.weight"] = torch.rand([hidden], generator=generator)
    tensors[f"{mtp}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"{mtp}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    for path in glob.glob(os.path.join(hf_dir, "*.safetensors")):
        os.remove(path)
    save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    return tensors


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_family_imports_and_exports_with_transformers_logits_and_generation(
    megatron_world1, bytelevel_dir, tmp_path, model_type, capsys
):
    from tools.checkpoint import convert

    hf_dir, ckpt, back = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "back")
    hf_model = random_hf(model_type, bytelevel_dir, hf_dir)
    assert convert.main(["import-hf", "--load", hf_dir, "--save", ckpt]) == 0
    out = capsys.readouterr().out
    assert "verify: max |logits(megatron_moe) - logits(transformers)|" in out, out
    cfg, ours, tokenizer = load_single(ckpt)
    family = hf_families.FAMILIES[model_type]
    assert hf_families.family_of(cfg) is family and hf_families.incompatibilities(cfg) == []
    assert tokenizer.tokenizer_type == "HuggingFaceTokenizer"
    if family.mla:  # YaRN's flags read from config.json
        assert cfg.model.mla_rope_type == "yarn" and cfg.model.rotary_scaling_factor == 40.0
    assert max_logit_difference(ours, hf_dir, probe_tokens(tokenizer.vocab_size)) < TOLERANCE

    prompt_BS = torch.tensor([tokenizer.tokenize("def main(argv):\n    parser = argparse.ArgumentParser(")])
    generated = hf_model.generate(prompt_BS, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(generated, _greedy(ours, prompt_BS, generated.shape[1] - prompt_BS.shape[1]))

    assert convert.main(["export-hf", "--load", ckpt, "--save", back]) == 0
    assert f"export: as HuggingFace {family.name} ({family.architecture})" in capsys.readouterr().out
    theirs, again = hf_tensors(hf_dir), hf_tensors(back)
    assert sorted(theirs) == sorted(again)
    assert [name for name in theirs if not torch.equal(theirs[name], again[name])] == []
    exported = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)
    assert type(exported).__name__ == family.architecture
    assert transformers.AutoTokenizer.from_pretrained(back).encode("x = 1") == tokenizer.tokenize("x = 1")
    corpus = tmp_path / "corpus.jsonl"  # the family's tokenizer makes training data
    corpus.write_text(json.dumps({"text": "def f(x):\n    return x + 1\n"}) + "\n")
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", back]
    written = preprocess_tool.main(["--input", str(corpus), *flags, "--output-prefix", str(tmp_path / "d")])
    assert written == {"text": len(tokenizer.tokenize("def f(x):\n    return x + 1\n"))}, written


def test_deepseek_v3s_mtp_layers_come_in_and_go_out_bit_for_bit(megatron_world1, bytelevel_dir, tmp_path, capsys):
    """A DeepSeek-V3 checkpoint carries its MTP layer after the decoder's (`model.layers.{L}`: enorm, hnorm, eh_proj,
    shared_head and a decoder layer's tensors, as DeepSeek publishes it; transformers ignores it): import makes it
    our --mtp-num-layers 1 and export writes it back unchanged. Without those tensors, import says so."""
    from tools.checkpoint import convert

    hf_dir = str(tmp_path / "hf")
    random_hf("deepseek_v3", bytelevel_dir, hf_dir)
    assert convert.main(["import-hf", "--load", hf_dir, "--save", str(tmp_path / "plain")]) == 0
    assert "num_nextn_predict_layers=1, its tensors carry 0 MTP layers" in capsys.readouterr().out

    tensors = add_an_mtp_layer(hf_dir)
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    assert convert.main(["import-hf", "--load", hf_dir, "--save", ckpt]) == 0
    cfg, ours, _ = load_single(ckpt)
    assert cfg.model.mtp_num_layers == 1
    assert torch.equal(ours.state_dict()["mtp.layers.0.eh_proj.weight"], tensors["model.layers.3.eh_proj.weight"])
    assert convert.main(["export-hf", "--load", ckpt, "--save", back]) == 0
    again = hf_tensors(back)
    assert sorted(again) == sorted(tensors)
    assert [name for name in tensors if not torch.equal(tensors[name], again[name])] == []


FLAGS = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-experts 4 --data-path x --tokenizer-model x"
EXPORTABLE = "--swiglu --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights"


@pytest.mark.parametrize(
    "flags, family",
    [
        ("", "mixtral"),
        ("--qk-layernorm --kv-channels 16", "qwen3_moe"),
        ("--moe-shared-expert-intermediate-size 16 --moe-shared-expert-gate --add-qkv-bias", "qwen2_moe"),
        ("--multi-latent-attention --qk-layernorm --moe-router-pre-softmax", "deepseek_v2"),
        ("--multi-latent-attention --qk-layernorm --moe-router-score-function sigmoid", "deepseek_v3"),
    ],
)
def test_the_family_a_run_exports_as_is_said_at_start_up(flags, family):
    cfg = parse_args([*FLAGS.split(), *EXPORTABLE.split(), *flags.split(), "--save", "s"])
    f = hf_families.FAMILIES[family]
    assert hf_families.family_of(cfg) is f and hf_families.incompatibilities(cfg) == []
    assert hf_families.startup_note(cfg) == f"export-hf writes this model as HuggingFace {f.name} ({f.architecture})"


@pytest.mark.parametrize(
    "flags, family, named",
    [
        ("--qk-layernorm --add-qkv-bias", "Qwen3-MoE", "--add-qkv-bias (Qwen3-MoE's attention has no biases"),
        ("--moe-shared-expert-intermediate-size 16", "Qwen2-MoE", "--moe-shared-expert-gate"),
        ("--multi-latent-attention", "DeepSeek-V2", "--qk-layernorm"),
        ("--multi-latent-attention --qk-layernorm", "DeepSeek-V2", "--moe-router-pre-softmax"),
        (
            "--multi-latent-attention --qk-layernorm --moe-router-score-function sigmoid --moe-router-topk 2 "
            "--moe-router-num-groups 2 --moe-router-group-topk 2",
            "DeepSeek-V3",
            "ranks groups by their top 2 scores, here by the top 1",
        ),
        (
            "--multi-latent-attention --qk-layernorm --moe-router-score-function sigmoid --moe-layer-freq [1,0]",
            "DeepSeek-V3",
            "dense layers are its first ones",
        ),
        (
            "--multi-latent-attention --qk-layernorm --moe-router-score-function sigmoid "
            "--moe-shared-expert-intermediate-size 24 --moe-ffn-hidden-size 16",
            "DeepSeek-V3",
            "a multiple of --moe-ffn-hidden-size=16",
        ),
    ],
)
def test_what_the_nearest_family_cannot_express_is_named(flags, family, named):
    cfg = parse_args([*FLAGS.split(), *EXPORTABLE.split(), *flags.split(), "--save", "s"])
    note = hf_families.startup_note(cfg)
    assert note.startswith(f"note: this model cannot be exported to HuggingFace (convert.py export-hf); as {family}")
    assert named in note, note


def test_an_hf_config_that_no_flag_expresses_is_refused_by_its_field():
    from megatron_moe.config import ConfigError

    config = {"model_type": "deepseek_v2", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
    config |= {"num_experts_per_tok": 6, "n_routed_experts": 16, "moe_intermediate_size": 8, "intermediate_size": 8}
    config |= {"kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}
    config |= {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 3}  # DeepSeek-V2's own routing
    with pytest.raises(ConfigError, match="topk_group=3 with num_experts_per_tok=6: not supported"):
        hf_families.run_flags_from_hf(config)
    with pytest.raises(ConfigError, match="YaRN's beta_fast=16"):
        hf_families.run_flags_from_hf(config | {"topk_group": 6, "rope_scaling": YARN | {"factor": 4, "beta_fast": 16}})
    qwen = {"model_type": "qwen3_moe", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}} | config
    with pytest.raises(ConfigError, match="rope_type='yarn': not supported .Qwen3-MoE's RoPE here is unscaled"):
        hf_families.run_flags_from_hf(qwen | {"model_type": "qwen3_moe"})
