"""Activation memory and step time of the activation policies, measured in one run.

    python -m tools.bench_activation_memory [--repeats 5] [--cases demo_model]

For each case (one MoE transformer layer at GPT2-S-MoE shapes; the demo
model; on request the earlier demo model, whose GPU figures docs/benchmarks.md
keeps) and policy (`none`, `full` = megatron-core whole-layer recompute,
`arctic`), prints one JSON object per line:

    {"case", "policy", "activation_bytes", "activation_ratio_vs_none",
     "step_ms", "step_ratio_vs_none", "peak_mem_bytes", ...}

`activation_bytes` is exact: every tensor autograd keeps for backward passes
through a saved-tensor hook that counts each storage once (quantized tensors
at their packed size, recompute recipes at the inputs they hold). `step_ms` is
the median forward+backward time after warm-up (until a round without page
faults, `tools/benchlib.py`), the policies timed in turn (round-robin) so
that machine noise affects them alike; `step_ratio_paired_vs_none` is the
median of the per-round ratios. `peak_mem_bytes` is the most memory in use
above the level before one more forward+backward (its weight gradients
included): allocated device memory on GPU, glibc's bytes in use on CPU
(`tools/benchlib.py`), a coarser view that includes transients.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

from tools.cli import HelpFormatter

CASE_NAMES = ("layer_gpt2s_moe", "demo_model", "gpt_moe_4l_2moe")
"""`CASES`' names, for the command line (built before torch loads)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per case and policy")
    parser.add_argument(
        "--cases", default=",".join(CASE_NAMES[:2]), help="comma-separated, of " + ", ".join(CASE_NAMES)
    )
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    return parser


if __name__ == "__main__":  # --help and a bad flag answer before torch and megatron-core load (seconds)
    build_parser().parse_args()

import torch  # noqa: E402

from megatron_moe.activations.apply import apply_activation_policy  # noqa: E402
from megatron_moe.activations.engine import SavedBytes  # noqa: E402
from megatron_moe.config import parse_args  # noqa: E402
from megatron_moe.platform import current_platform, synchronize  # noqa: E402
from megatron_moe.platform.process import init_single_process  # noqa: E402
from tools.benchlib import measure_rounds, median_ratio, peak_bytes  # noqa: E402

CASES = {
    # One MoE transformer layer, GPT2-S-MoE shapes: 1024 tokens (seq 512 x micro-batch 2).
    "layer_gpt2s_moe": dict(
        layers=1,
        flags=(
            "--num-layers 1 --hidden-size 768 --num-attention-heads 12 --ffn-hidden-size 3072 --num-experts 8 "
            "--moe-router-topk 2 --moe-aux-loss-coeff 0.01 --seq-length 512"
        ).split(),
        micro_batch=2,
    ),
    # The demo model (examples/pretrain_gpt_moe_tiny_cpu.sh, Mixtral-shaped), whole model with embeddings and
    # loss, all 8 experts of each layer on one rank (the demo's EP=2 holds 4), its micro-batch of 4.
    "demo_model": dict(
        layers=None,
        flags=(
            "--num-layers 4 --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 4 --seq-length 256 "
            "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
            "--untie-embeddings-and-output-weights --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 0.01"
        ).split(),
        micro_batch=4,
    ),
    # The demo model before it became Mixtral-shaped (4 GPT layers, every second MoE, GELU, LayerNorm), at its
    # micro-batch of 8: the case docs/benchmarks.md's H100 and H200 figures are of.
    "gpt_moe_4l_2moe": dict(
        layers=None,
        flags=(
            "--num-layers 4 --hidden-size 256 --num-attention-heads 4 --num-experts 8 --moe-router-topk 2 "
            "--moe-layer-freq 2 --moe-aux-loss-coeff 0.01 --seq-length 256"
        ).split(),
        micro_batch=8,
    ),
}
assert tuple(CASES) == CASE_NAMES, "CASE_NAMES lists CASES for the command line"
POLICIES = {
    "none": [],
    "full": ["--recompute-granularity", "full"],
    "arctic": ["--activation-policy", "arctic"],
}
VOCAB = 4096


def build(case: dict, policy_flags: list[str]):
    """(cfg, model, selective policy or None) for one case; the caller installs the policy."""
    from megatron_moe.model import build_model, transformer_config

    # Built without DDP: no main_grad for the gradient-accumulation fusion (a GPU with apex) to accumulate into.
    flags = [*case["flags"], *policy_flags, "--no-gradient-accumulation-fusion"]
    cfg = parse_args([*flags, "--data-path", "x", "--tokenizer-model", "x"])
    cfg.validate(world_size=1)
    config = transformer_config(cfg)
    policy = cfg.activation_policy()
    torch.manual_seed(0)
    model = build_model(_without_policy(cfg), config, VOCAB).to(current_platform().device)
    return cfg, model, policy


def _without_policy(cfg):
    """The same config with the selective policy left for the benchmark to install (with its counter)."""
    import copy

    cfg = copy.deepcopy(cfg)
    cfg.activations.activation_policy = "none"
    cfg.activations.recompute_modules, cfg.activations.quantize_activations = [], []
    if cfg.activations.recompute_granularity == "selective":
        cfg.activations.recompute_granularity = None
    return cfg


def forward_backward(model, cfg, case, counter: SavedBytes | None):
    device = current_platform().device
    seq, mbs = cfg.model.seq_length, case["micro_batch"]
    g = torch.Generator().manual_seed(0)
    if case["layers"]:  # one transformer layer on hidden states [S, B, H]
        x = torch.randn(seq, mbs, cfg.model.hidden_size, generator=g).to(device).requires_grad_()
        layer = model.decoder
        ctx = counter.counting() if counter else _null()
        with ctx:
            out = layer(x, attention_mask=None, rotary_pos_emb=model.rotary_pos_emb(seq))
        out.float().square().mean().backward()
        return
    tokens = torch.randint(0, VOCAB, (mbs, seq), generator=g).to(device)
    position_ids = torch.arange(seq, device=device).expand(mbs, seq)
    ctx = counter.counting() if counter else _null()
    with ctx:
        loss = model(tokens, position_ids, None, labels=tokens)
    loss.float().mean().backward()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def measure_case(case_name: str, repeats: int) -> list[dict]:
    """All policies of one case; timed round-robin so machine noise hits them alike."""
    case = CASES[case_name]
    runs = {}
    for policy_name, flags in POLICIES.items():
        cfg, model, policy = build(case, flags)
        counter = SavedBytes()
        scope = apply_activation_policy(model, policy, counter) if policy is not None else None
        forward_backward(model, cfg, case, counter)  # the counted pass (also a warm-up)
        if scope is not None:
            scope.counter = None  # count one pass only
        runs[policy_name] = (cfg, model, counter.bytes)
    steps = {name: functools.partial(_step, model, cfg, case) for name, (cfg, model, _) in runs.items()}
    times, warmup, faults = measure_rounds(steps, warmup=2, max_warmup=10, repeats=repeats, sync=synchronize)
    peaks = {name: peak_bytes(step, current_platform()) for name, step in steps.items()}
    return [
        {
            "case": case_name,
            "policy": name,
            "activation_bytes": nbytes,
            "step_ms": round(statistics.median(times[name]), 2),
            "peak_mem_bytes": peaks[name],
            "step_ms_all": [round(t, 1) for t in times[name]],
            "warmup": warmup,
            "page_faults_timed": faults[name],
        }
        for name, (_, _, nbytes) in runs.items()
    ]


def _step(model, cfg, case):
    model.zero_grad(set_to_none=True)
    forward_backward(model, cfg, case, None)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    unknown = sorted(set(args.cases.split(",")) - set(CASES))
    if unknown:
        build_parser().error(f"--cases {args.cases}: no case {unknown[0]!r}; choose from {','.join(CASES)}")
    torch.set_num_threads(args.threads)
    init_single_process(seed=1234)
    for case_name in args.cases.split(","):
        results = measure_case(case_name, args.repeats)
        base = results[0]
        for r in results:
            r["activation_ratio_vs_none"] = round(r["activation_bytes"] / base["activation_bytes"], 4)
            r["step_ratio_vs_none"] = round(r["step_ms"] / base["step_ms"], 4)
            r["step_ratio_paired_vs_none"] = median_ratio(r["step_ms_all"], base["step_ms_all"])
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
