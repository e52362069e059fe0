"""HuggingFace Mixtral export and import, checked against transformers' own model by logits."""

import copy
import json
import logging
import os

import pytest
import torch

from megatron_moe.checkpointing import hf_families
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
    problems = hf_families.incompatibilities(cfg, hf_families.MIXTRAL)
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
    with pytest.raises(ConfigError, match="cannot be written as Qwen2-MoE") as error:  # a shared expert: Qwen2's
        hf_families.check_exportable(cfg)
    assert "--moe-shared-expert-gate" in str(error.value)
    assert hf_families.incompatibilities(mixtral_cfg(tokenizer)) == []


def test_hf_config_round_trip(tokenizer):
    cfg = mixtral_cfg(tokenizer)
    config = hf_families.hf_config(cfg, tokenizer.vocab_size, tokenizer.bos, tokenizer.eod)
    assert json.loads(json.dumps(config))["num_key_value_heads"] == 2
    again = parse_args([*hf_families.run_flags_from_hf(config), "--data-path", "x", "--tokenizer-model", "x"])
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


@torch.no_grad()
def _greedy(model, tokens_BS: torch.Tensor, steps: int) -> torch.Tensor:
    """Our model's greedy continuation of `tokens_BS` by `steps` tokens, recomputing the whole prefix each step."""
    from megatron_moe.checkpointing.hf_convert import logits

    for _ in range(steps):
        next_B = logits(model, tokens_BS)[:, -1].argmax(dim=-1)
        tokens_BS = torch.cat([tokens_BS, next_B[:, None]], dim=1)
    return tokens_BS


def test_the_demo_model_exports_and_transformers_generates_from_it(megatron_world1, tokenizer, tmp_path, capsys):
    """`make demo`, then the README's export command: the demo script's own model (its flags, DRY_RUN) is one
    export-hf writes (the real command, its logit check included); transformers' AutoModelForCausalLM loads it with
    our logits (fp32, 1e-4) and its generate (KV cache) continues a prompt greedily as our model does."""
    from tests.unit.test_examples import dry_run
    from tools.checkpoint import convert

    flags = dry_run("pretrain_gpt_moe_tiny_cpu", 1, 2, TOKENIZER_MODEL=tokenizer.model_path, RUN_DIR=str(tmp_path))
    cfg = parse_args(flags)
    assert cfg.moe.layer_pattern(cfg.model.num_layers) == [1, 1, 1, 1] and cfg.checkpoint.save
    assert hf_families.incompatibilities(cfg) == []
    assert hf_families.startup_note(cfg) == "export-hf writes this model as HuggingFace Mixtral (MixtralForCausalLM)"
    torch.manual_seed(5)
    model = build_single(cfg, tokenizer.vocab_size)
    with torch.no_grad():  # non-trivial norms, so a swapped norm would show
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    save_single(ckpt, cfg, model)
    assert convert.main(["export-hf", "--load", ckpt, "--save", out]) == 0
    assert "verify: max |logits(megatron_moe) - logits(transformers)|" in capsys.readouterr().out

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "MixtralForCausalLM"
    _, ours, _ = load_single(ckpt)
    prompt_BS = torch.tensor([tokenizer.tokenize("def main(argv):\n    parser = argparse.ArgumentParser(")])
    with torch.no_grad():
        theirs_BSV = hf_model(prompt_BS).logits
        ours_BSV = ours(prompt_BS, torch.arange(prompt_BS.shape[1])[None], None)[..., : theirs_BSV.shape[-1]]
    assert (ours_BSV - theirs_BSV).abs().max().item() < TOLERANCE
    generated = hf_model.generate(prompt_BS, max_new_tokens=6, do_sample=False)
    steps = generated.shape[1] - prompt_BS.shape[1]  # fewer than 6 where it ended at the end-of-document token
    assert steps >= 1 and torch.equal(generated, _greedy(ours, prompt_BS, steps))


def test_a_run_that_saves_a_model_export_would_refuse_is_told_at_start_up(tokenizer, caplog):
    """The rules export-hf refuses by (`incompatibilities`), said in one line of the start-up summary of a run with
    --save (a note: the run goes on); nothing for an exportable model or a run that saves nothing."""
    from megatron_moe.model import run_fusions
    from megatron_moe.training.summary import log_startup_summary

    counts = {"total": 1, "active_per_token": 1, "this_rank": 1}
    old_demo = "--num-experts 8 --moe-layer-freq 2 --normalization LayerNorm --data-path x --tokenizer-model x".split()
    old_demo += ["--train-iters", "3", "--global-batch-size", "2"]

    def summary(cfg) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron_moe"):
            log_startup_summary(cfg, counts, tokenizer, {}, run_fusions(cfg))
        return [r.getMessage() for r in caplog.records if "HuggingFace" in r.getMessage()]

    cfg = parse_args([*old_demo, "--save", "s"])
    (note,) = summary(cfg)
    assert note.startswith(
        "note: this model cannot be exported to HuggingFace (convert.py export-hf); as Mixtral, the nearest family: "
    )
    assert "\n" not in note and note.endswith("; ".join(hf_families.incompatibilities(cfg)))
    for feature in ("--moe-layer-freq=2", "--swiglu", "--normalization=LayerNorm", "--disable-bias-linear"):
        assert feature in note, (feature, note)
    assert summary(parse_args(old_demo)) == []  # nothing saved, nothing to export
    assert summary(mixtral_cfg(tokenizer, "--save", "s", *old_demo[-4:])) == [
        "export-hf writes this model as HuggingFace Mixtral (MixtralForCausalLM)"
    ]


def test_the_export_rules_name_each_routing_mixtral_cannot_express(tokenizer):
    for extra, named in [
        (["--moe-layer-impl", "mcore"], "--moe-layer-impl=mcore"),
        (["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"], "--moe-router-group-topk=1"),
        (["--moe-router-topk-scaling-factor", "2.5"], "--moe-router-topk-scaling-factor=2.5"),
        (["--moe-router-pre-softmax"], "not renormalised"),
        (["--moe-gate", "noisy_topk"], "--moe-gate=noisy_topk"),
    ]:
        (problem,) = hf_families.incompatibilities(mixtral_cfg(tokenizer, *extra))
        assert named in problem, (extra, problem)


@pytest.mark.parametrize(
    "training",
    [
        "--moe-expert-capacity-factor 0.5 --moe-token-drop-policy probs",
        "--expert-model-parallel-size 2 --moe-shadow-experts auto --moe-pipeline-degree 2 --moe-a2a-algorithm 2dh",
        "--moe-router-force-load-balancing",  # Megatron-LM's DeepSeek-V3 script: random logits in training
    ],
    ids=["capacity", "ep2_overlaps", "forced_routing"],
)
def test_how_a_model_was_trained_does_not_stop_its_export(megatron_world1, tokenizer, tmp_path, training):
    """A capacity factor and the overlaps of a layout are training choices, not weights: export and its logit check
    run our model in one process as transformers runs Mixtral, dropless (a capacity of half the tokens would drop
    some of the probe's)."""
    cfg = mixtral_cfg(tokenizer, *training.split())
    assert hf_families.incompatibilities(cfg) == []
    torch.manual_seed(3)
    model = build_single(copy.deepcopy(cfg), tokenizer.vocab_size)
    save_single(str(tmp_path / "ckpt"), cfg, model)  # the run's config recorded
    out = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    _, model, _ = load_single(str(tmp_path / "ckpt"))
    assert max_logit_difference(model, out, probe_tokens(tokenizer.vocab_size)) < TOLERANCE


@pytest.mark.parametrize("disk", ["full", "read_only"])
def test_export_onto_a_full_or_read_only_disk_is_one_line_and_leaves_no_tmp(our_checkpoint, tmp_path, disk):
    """Before: a 20-line traceback (safetensors' or os' error) and an empty `hf.tmp/` left behind (issue 41)."""
    from megatron_moe.config import ConfigError
    from tests.unit.unwritable import full, read_only

    folder = str(tmp_path / "out")
    with full(folder, "64k") if disk == "full" else read_only(folder), pytest.raises(ConfigError) as error:
        export_hf(our_checkpoint, os.path.join(folder, "hf"))
    assert os.listdir(folder) == []  # no hf.tmp/, no hf/
    text = str(error.value)
    assert text.startswith(f"--save={folder}/hf: cannot write ") and "\n" not in text, text
    assert ("No space left on device" if disk == "full" else "Read-only file system") in text, text


def test_import_into_a_read_only_folder_is_one_line_and_leaves_nothing(megatron_world1, tokenizer, tmp_path):
    from megatron_moe.config import ConfigError
    from tests.unit.unwritable import read_only

    hf_dir = str(tmp_path / "hf")
    _random_hf_mixtral(tokenizer, hf_dir, published_names=False)
    with read_only(str(tmp_path / "ro")) as folder, pytest.raises(ConfigError) as error:
        import_hf(hf_dir, os.path.join(folder, "ckpt"))
    assert str(error.value).startswith(f"--save={folder}/ckpt: cannot write {folder}/ckpt.tmp: Read-only file system")


def test_reshard_into_a_read_only_folder_is_one_line_with_exit_code_2(our_checkpoint, tmp_path, capsys):
    """Before: a raw OSError traceback from the staging directory (exit 1)."""
    from tests.unit.unwritable import read_only
    from tools.checkpoint.convert import main

    with read_only(str(tmp_path / "ro")) as folder:
        code = main(["reshard", "--load", our_checkpoint, "--save", os.path.join(folder, "dst")])
        assert os.listdir(folder) == []
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in out.err, out
    assert lines[0].startswith(f"error: --save={folder}/dst: cannot write {folder}") and "Read-only" in lines[0]
