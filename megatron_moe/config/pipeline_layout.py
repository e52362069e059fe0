"""The pipeline's stage flags: Megatron-LM's interleaved-pipeline flags and --pipeline-model-parallel-layout, its
per-stage layout string, read and checked at the flag pass.

megatron-core builds from the string itself (`TransformerConfig.pipeline_model_parallel_layout`); the flag pass
must not import it (seconds of start-up), so the grammar and megatron-core's checks
(`PipelineParallelLayerLayout.parse_str_to_list` and `validate_layer_layout`, 0.16.1) are read here the same way,
each refusal naming the flag. tests/unit/test_pipeline_layout.py holds the two to the same answers.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from megatron_moe.config.fields import require, require_positive

if TYPE_CHECKING:
    from megatron_moe.config.groups import ModelConfig, ParallelConfig

FLAG = "--pipeline-model-parallel-layout"
SYMBOLS = {"E": "the embedding", "t": "a transformer layer", "m": "an MTP layer", "L": "the loss"}


def pipeline_layout_stages(layout: str) -> list[str]:
    """The stages of `layout`, each a string of E/t/m/L (megatron-core's parse: commas dropped, `(..)*n` then `x*n`
    unrolled, split at `|`); unknown characters are left in for `check_pipeline_layout` to name."""
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), text)
    return text.split("|")


def check_pipeline_layout(layout: str, pp: int, num_layers: int, mtp_num_layers: int | None) -> None:
    """megatron-core's conditions on a layout, before any start-up: known symbols, PP x V stages, one E first and
    one L last, --num-layers t's, the MTP layers after every t and together in one stage of the last chunk; and,
    this stack's own limit, that stage on the last pipeline rank."""
    stages = pipeline_layout_stages(layout)
    unknown = sorted(set("".join(stages)) - set(SYMBOLS))
    require(
        not unknown,
        FLAG,
        layout,
        f"unknown symbol {', '.join(map(repr, unknown))}; the symbols: "
        + ", ".join(f"{k} {v}" for k, v in SYMBOLS.items())
        + "; | ends a stage, (..)*n repeats",
    )
    require(
        len(stages) % pp == 0,
        FLAG,
        layout,
        f"has {len(stages)} stages: a multiple of --pipeline-model-parallel-size={pp} is needed (PP x the model "
        "chunks per rank)",
    )
    flat = "".join(stages)
    require(
        flat.count("E") == 1 and flat.count("L") == 1 and flat[:1] == "E" and flat[-1:] == "L",
        FLAG,
        layout,
        "must start with the embedding (E) and end with the loss (L), each once",
    )
    require(
        flat.count("t") == num_layers,
        FLAG,
        layout,
        f"places {flat.count('t')} transformer layers (t); --num-layers={num_layers}",
    )
    mtp = mtp_num_layers or 0
    require(
        flat.count("m") == mtp,
        FLAG,
        layout,
        f"places {flat.count('m')} MTP layers (m); --mtp-num-layers={mtp}",
    )
    if not mtp:
        return
    require(
        "t" not in flat[flat.index("m") :],
        FLAG,
        layout,
        "the MTP layers (m) come after every transformer layer (t)",
    )
    chunks = len(stages) // pp
    # stage s is pipeline rank s % pp's chunk s // pp (megatron-core's layout[pp_rank][vpp_rank])
    holding = [s for s, stage in enumerate(stages) if "m" in stage]
    require(
        len(holding) == 1 and holding[0] // pp == chunks - 1,
        FLAG,
        layout,
        "the MTP layers (m) go together in one stage of the last model chunk (one of the last "
        f"--pipeline-model-parallel-size={pp} stages)",
    )
    require(
        holding[0] % pp == pp - 1,
        FLAG,
        layout,
        "the MTP layers (m) go on the last pipeline rank, in the loss's stage, here (megatron-core's standalone MTP "
        f"stage on another rank is not run here), e.g. the last stage ...mL of the {pp} x {chunks}",
    )


def check_virtual_pipeline(parallel: ParallelConfig, model: ModelConfig) -> None:
    """The interleaved pipeline's flags (Megatron-LM's rules): one of the two, PP > 1, whole layers per chunk."""
    per_stage, chunks = parallel.num_layers_per_virtual_pipeline_stage, parallel.num_virtual_stages_per_pipeline_rank
    pp, layers = parallel.pipeline_model_parallel_size, model.num_layers
    layout = parallel.pipeline_model_parallel_layout
    if layout is not None:
        named = [("--num-layers-per-virtual-pipeline-stage", per_stage)]
        named += [("--num-virtual-stages-per-pipeline-rank", chunks)]
        given = " and ".join(flag for flag, value in named if value is not None)
        require(not given, FLAG, layout, f"sets the model chunks per rank itself; drop {given}")
        check_pipeline_layout(layout, pp, layers, model.mtp_num_layers)
        return
    if per_stage is None and chunks is None:
        return
    require(
        per_stage is None or chunks is None,
        "--num-layers-per-virtual-pipeline-stage",
        per_stage,
        f"give it or --num-virtual-stages-per-pipeline-rank={chunks}, not both (they say the same thing)",
    )
    flag, value = (
        ("--num-layers-per-virtual-pipeline-stage", per_stage)
        if per_stage is not None
        else ("--num-virtual-stages-per-pipeline-rank", chunks)
    )
    require_positive(flag, value, 1)
    require(
        pp > 1,
        flag,
        value,
        "the interleaved pipeline splits each pipeline rank's layers into chunks; it needs "
        f"--pipeline-model-parallel-size > 1 (now {pp}), e.g. --pipeline-model-parallel-size 2",
    )
    if per_stage is not None:
        require(
            layers % pp == 0 and (layers // pp) % per_stage == 0,
            flag,
            value,
            f"must divide the layers per pipeline stage (--num-layers={layers} / "
            f"--pipeline-model-parallel-size={pp}), e.g. {_largest_divisor(layers // pp, per_stage)}",
        )
    else:
        require(
            layers % (pp * chunks) == 0,
            flag,
            value,
            f"--num-layers={layers} must be a multiple of --pipeline-model-parallel-size x chunks = "
            f"{pp} x {chunks}, e.g. {flag} {_largest_divisor(layers // pp if layers % pp == 0 else 1, chunks)}",
        )


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of `n` that is at most `at_most` (1 at least): a valid choice to name in an error."""
    return next(d for d in range(max(min(n, at_most), 1), 0, -1) if n % d == 0)
