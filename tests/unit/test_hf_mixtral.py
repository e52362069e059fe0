"""HuggingFace Mixtral export and import, checked against transformers' own model by logits."""

import json
import os

import pytest
import torch

from megatron_moe.checkpointing import hf_mixtral
from megatron_moe.checkpointing.hf_convert import (
    build_single,
    export_hf,
    import_hf,
    load_single,
    max_logit_difference,
    probe_tokens,
    save_single,
)
from megatron_moe.config import ConfigError, parse_args

transformers = pytest.importorskip("transformers")
TOLERANCE = 1e-4
MIXTRAL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 --ffn-hidden-size 96 "
    "--num-experts 4 --moe-router-topk 2 --swiglu --normalization RMSNorm --disable-bias-linear "
    "--untie-embeddings-and-output-weights --position-embedding-type rope --rotary-base 10000 --seq-length 32 "
    "--data-path x"
).split()


def mixtral_cfg(tokenizer, *extra):
    return parse_args([*MIXTRAL, "--tokenizer-model", tokenizer.model_path, *extra])


@pytest.fixture
def our_checkpoint(megatron_world1, tokenizer, tmp_path):
    cfg = mixtral_cfg(tokenizer)
    torch.manual_seed(3)
    model = build_single(cfg, tokenizer.vocab_size)
    with torch.no_grad():  # non-trivial norms, so a swapped norm would show
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
    save_single(str(tmp_path / "ckpt"), cfg, model)
    return str(tmp_path / "ckpt")


def test_export_matches_transformers(our_checkpoint, tmp_path):
    out = export_hf(our_checkpoint, str(tmp_path / "hf"))
    names = set()
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    _, model, tokenizer = load_single(our_checkpoint)
    diff = max_logit_difference(model, out, probe_tokens(tokenizer.vocab_size))
    assert diff < TOLERANCE, diff
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x  # ok"
    assert hf_tok.encode(text) == tokenizer.tokenize(text)


def test_export_never_overwrites(our_checkpoint, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        export_hf(our_checkpoint, str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "keep.txt").exists()


def _random_hf_mixtral(tokenizer, directory, published_names: bool):
    config = transformers.MixtralConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(11)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)  # transformers 5 writes the published per-expert names
    if not published_names:  # rewrite with the in-memory fused expert tensors instead
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert "model.layers.0.mlp.experts.gate_up_proj" in state
        save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    import shutil

    shutil.copyfile(tokenizer.model_path, os.path.join(directory, "tokenizer.model"))
    return model


@pytest.mark.parametrize("published_names", [False, True], ids=["fused", "published"])
def test_import_matches_transformers(megatron_world1, tokenizer, tmp_path, published_names):
    hf_dir = str(tmp_path / "hf")
    _random_hf_mixtral(tokenizer, hf_dir, published_names)
    ckpt = import_hf(hf_dir, str(tmp_path / "ckpt"))
    _, model, _ = load_single(ckpt)
    diff = max_logit_difference(model, hf_dir, probe_tokens(tokenizer.vocab_size))
    assert diff < TOLERANCE, diff


def test_unexpressible_features_are_listed(tokenizer):
    cfg = parse_args(
        (
            "--num-layers 2 --num-experts 4 --moe-layer-freq 2 --moe-shared-expert-ffn-hidden-size 64 "
            "--position-embedding-type learned_absolute --moe-gate sigmoid --data-path x --tokenizer-model x"
        ).split()
    )
    problems = hf_mixtral.incompatibilities(cfg)
    text = "\n".join(problems)
    for feature in (
        "--moe-layer-freq=2",
        "GELU",
        "LayerNorm",
        "learned_absolute",
        "biases",
        "tied",
        "--moe-gate=sigmoid",
        "shared expert",
    ):
        assert feature in text, (feature, text)
    with pytest.raises(ConfigError, match="cannot be written as Mixtral"):
        hf_mixtral.check_exportable(cfg)
    assert hf_mixtral.incompatibilities(mixtral_cfg(tokenizer)) == []


def test_hf_config_round_trip(tokenizer):
    cfg = mixtral_cfg(tokenizer)
    config = hf_mixtral.hf_config(cfg, tokenizer.vocab_size, tokenizer.bos, tokenizer.eod)
    assert json.loads(json.dumps(config))["num_key_value_heads"] == 2
    again = parse_args([*hf_mixtral.run_flags_from_hf(config), "--data-path", "x", "--tokenizer-model", "x"])
    assert again.model.num_query_groups == 2 and again.moe.num_experts == 4 and again.model.swiglu


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_export_carries_the_runs_tokenizer_and_import_reads_it_back(
    megatron_world1, corpus, tokenizer_flags, tmp_path, kind
):
    """A run on the byte-level BPE (as GPT-2's files or as a tokenizer.json) exports it; transformers'
    AutoTokenizer encodes as we do; import-hf records the directory's tokenizer.json as the run's."""
    from megatron_moe.data.tokenizer import build_tokenizer

    cfg = parse_args([*MIXTRAL, *tokenizer_flags[kind]])
    ours = build_tokenizer(cfg.data)
    save_single(str(tmp_path / "ckpt"), cfg, build_single(cfg, ours.vocab_size))
    out = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    expected = {"tokenizer.json", "tokenizer_config.json"} | ({"vocab.json", "merges.txt"} if "GPT2" in kind else set())
    assert expected <= set(os.listdir(out)) and "tokenizer.model" not in os.listdir(out)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in [*corpus[1][:3], "def f(x):\n    return x  # caf\u00e9 \U0001f600\n"]:
        assert hf_tok.encode(text) == ours.tokenize(text)
    assert hf_tok.eos_token_id == ours.eod == json.load(open(os.path.join(out, "config.json")))["eos_token_id"]
    _, model, _ = load_single(str(tmp_path / "ckpt"))
    assert max_logit_difference(model, out, probe_tokens(ours.vocab_size)) < TOLERANCE
    imported = import_hf(out, str(tmp_path / "imported"))
    cfg_back, _, theirs = load_single(imported)
    assert cfg_back.data.tokenizer_type == "HuggingFaceTokenizer"
    assert theirs.files == (os.path.join(imported, "tokenizer.json"),)
    assert theirs.tokenize(corpus[1][0]) == ours.tokenize(corpus[1][0]) and theirs.eod == ours.eod
