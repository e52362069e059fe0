"""HuggingFace conversion speed: `import-hf` and `export-hf` of a ~1 GB DeepSeek-V3-shaped checkpoint against the
time to read and write its bytes (issue 42's target: within 2x).

    python -m tools.bench_hf_convert [--gigabytes 1.0] [--repeats 2]

The checkpoint: transformers' DeepSeek-V3 layout (MLA with a query LoRA, a dense first layer, routed and shared
experts, the correction bias) in one fp32 model.safetensors with random weights, sized by its expert count; the
tokenizer a byte-level BPE trained on the stdlib corpus. `io_s`: safetensors reads the file and writes it again
(the bytes each conversion must at least move); `import_s` / `export_s`: the conversions alone, without the logit
check the CLI adds (that runs both models). One JSON line per repeat, then the ratios of the best of --repeats (a
warm process) and the first repeat's times (its imports and set-up included, as a fresh CLI process pays them).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

SHAPE = dict(
    hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8, n_shared_experts=1, first_k_dense_replace=1, num_experts_per_tok=8, n_group=8,
    topk_group=4, q_lora_rank=384, kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
    routed_scaling_factor=2.5,
)  # fmt: skip
EXPERT_BYTES = 3 * 1024 * 512 * 4 * (SHAPE["num_hidden_layers"] - SHAPE["first_k_dense_replace"])


def write_checkpoint(directory: str, gigabytes: float, tokenizer_dir: str) -> int:
    """A random DeepSeek-V3 directory of about `gigabytes` (experts a multiple of n_group, 2 per group at least: the
    chosen groups must hold the top-k); returns its bytes."""
    import shutil

    import torch
    import transformers
    from safetensors.torch import save_file

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    experts = max(2, round(gigabytes * 1e9 / EXPERT_BYTES / SHAPE["n_group"])) * SHAPE["n_group"]
    config = transformers.DeepseekV3Config(vocab_size=len(tokenizer), n_routed_experts=experts, **SHAPE)
    with torch.device("meta"):
        shapes = {
            name: t.shape for name, t in transformers.AutoModelForCausalLM.from_config(config).state_dict().items()
        }
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator) * 0.02 for name, shape in shapes.items()}
    tensors = _published(tensors)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(directory)
    for name in os.listdir(tokenizer_dir):
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(directory, name))
    return os.path.getsize(os.path.join(directory, "model.safetensors"))


def _published(tensors: dict) -> dict:
    """transformers' in-memory fused experts in the per-expert names its save_pretrained writes."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            block = name.removesuffix("gate_up_proj")
            for e, w in enumerate(tensor.unbind(0)):
                out[f"{block}{e}.gate_proj.weight"], out[f"{block}{e}.up_proj.weight"] = w.chunk(2)
        elif name.endswith("mlp.experts.down_proj"):
            block = name.removesuffix("down_proj")
            out.update({f"{block}{e}.down_proj.weight": w.clone() for e, w in enumerate(tensor.unbind(0))})
        else:
            out[name] = tensor
    return {name: t.contiguous() for name, t in out.items()}


def read_and_write(path: str, destination: str) -> float:
    from safetensors.torch import load_file, save_file

    start = time.perf_counter()
    save_file(load_file(path), destination, metadata={"format": "pt"})
    os.sync()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gigabytes", type=float, default=1.0, help="checkpoint size (default 1.0)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each measurement; the best is kept (default 2)")
    args = parser.parse_args(argv)

    from megatron_moe.checkpointing.hf_convert import export_hf, import_hf
    from tools import make_stdlib_corpus, train_tokenizer

    quiet = lambda line: None  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        make_stdlib_corpus.main(["--output", corpus, "--max-bytes", "2000000"])
        tokenizer = train_tokenizer.main(
            ["--input", corpus, "--model-type", "bytelevel-bpe", "--model-prefix", f"{tmp}/bpe", "--vocab-size", "8192"]
        )
        hf = os.path.join(tmp, "hf")
        os.makedirs(hf)
        size = write_checkpoint(hf, args.gigabytes, tokenizer)
        best, first = {"io_s": float("inf"), "import_s": float("inf"), "export_s": float("inf")}, None
        for repeat in range(args.repeats):
            best["io_s"] = min(best["io_s"], read_and_write(f"{hf}/model.safetensors", f"{tmp}/copy.safetensors"))
            start = time.perf_counter()
            import_hf(hf, f"{tmp}/ckpt", overwrite=True, progress=quiet)
            os.sync()
            best["import_s"] = min(best["import_s"], time.perf_counter() - start)
            start = time.perf_counter()
            export_hf(f"{tmp}/ckpt", f"{tmp}/back", overwrite=True, progress=quiet)
            os.sync()
            best["export_s"] = min(best["export_s"], time.perf_counter() - start)
            first = first or dict(best)  # the first: the conversions' own imports and set-up included
            print(json.dumps({"repeat": repeat + 1, "bytes": size, **best}), flush=True)
        print(
            json.dumps(
                {
                    "family": "deepseek_v3",
                    "gigabytes": round(size / 1e9, 3),
                    **{k: round(v, 2) for k, v in best.items()},
                    "import_vs_io": round(best["import_s"] / best["io_s"], 2),
                    "export_vs_io": round(best["export_s"] / best["io_s"], 2),
                    "first_import_s": round(first["import_s"], 2),
                    "first_export_s": round(first["export_s"], 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
