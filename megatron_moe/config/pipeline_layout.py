"""--pipeline-model-parallel-layout: Megatron-LM's per-stage layout string, read and checked at the flag pass.

megatron-core builds from the string itself (`TransformerConfig.pipeline_model_parallel_layout`); the flag pass
must not import it (seconds of start-up), so the grammar and megatron-core's checks
(`PipelineParallelLayerLayout.parse_str_to_list` and `validate_layer_layout`, 0.16.1) are read here the same way,
each refusal naming the flag. tests/unit/test_pipeline_layout.py holds the two to the same answers.
"""

from __future__ import annotations

import re

from megatron_moe.config.fields import require

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
