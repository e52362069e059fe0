"""Every router combination our flag pass lets through builds megatron-core's TransformerConfig (issue 41): its
`__post_init__` refused `--moe-router-topk 1` with a softmax score and no pre-softmax at start-up, after "flags OK"
(also under DRY_RUN=1). docs/troubleshooting.md, "Directories, caches and tools"."""

import itertools

import pytest

from megatron_moe.config import ConfigError, parse_and_validate

BASE = ["--data-path", "d", "--tokenizer-model", "t.model", "--num-experts", "4", "--num-layers", "2"]
BASE += ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16"]


def test_topk_1_with_megatron_cores_softmax_router_is_refused_in_the_flag_pass_naming_the_fix():
    with pytest.raises(ConfigError) as error:
        parse_and_validate([*BASE, "--moe-layer-impl", "mcore", "--moe-router-topk", "1"], 1)
    assert str(error.value).startswith("--moe-router-topk=1: megatron-core's layer (--moe-layer-impl mcore) routes")
    assert "add it, or --moe-router-score-function sigmoid" in str(error.value)


ROUTERS = [
    [*impl, *topk, *score, *pre, *balancing]
    for impl, topk, score, pre, balancing in itertools.product(
        ([], ["--moe-layer-impl", "mcore"]),
        (["--moe-router-topk", "1"], ["--moe-router-topk", "2"]),
        ([], ["--moe-router-score-function", "softmax"], ["--moe-router-score-function", "sigmoid"]),
        ([], ["--moe-router-pre-softmax"]),
        ([], ["--moe-router-load-balancing-type", "sinkhorn"], ["--moe-router-load-balancing-type", "none"]),
    )
]


def test_every_router_the_flag_pass_accepts_builds_megatron_cores_config():
    """Before: with our layer too, any top-1 run (its TransformerConfig had the default softmax, no pre-softmax)."""
    from megatron_moe.model import transformer_config

    accepted, refused = 0, []
    for flags in ROUTERS:
        try:
            cfg = parse_and_validate([*BASE, *flags], 1)
        except ConfigError:
            continue
        accepted += 1
        try:
            transformer_config(cfg)
        except (ValueError, AssertionError) as error:
            refused.append(f"{' '.join(flags)}: {error}")
    assert refused == [] and accepted >= 20, (accepted, refused)
