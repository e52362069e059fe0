"""Megatron-LM's DeepSeek-V3, DeepSeek-V2-Lite, Qwen3-30B-A3B and Qwen2-57B-A14B flags (examples/megatron_lm/, only
sizes, degrees and paths changed) train as written, each through its own torchrun line on CPU processes (gloo),
on tokenized data through a HuggingFace tokenizer: 4 iterations, validated and saved at 2 and 4; then resumed from
the save at 2, where iterations 3 and 4 train to the same losses (exact resume).

Their dry runs (the flag pass on the world each asks torchrun for) are tests/unit/test_megatron_lm_scripts.py."""

import json
import os
import re
import shutil
import subprocess

import pytest

from tests.conftest import preprocess_tool
from tests.distributed.test_megatron_lm_scripts import SCRIPTS, job_env

FAMILIES = {
    # script -> (its layout line, a start-up line it must print)
    "deepseek_v3": ("world=2 TP=1 PP=1 CP=1 EP=2 DP=2", "--moe-token-dispatcher-type flex"),
    "deepseek_v2_lite": ("world=2 TP=1 PP=1 CP=1 EP=2 DP=2", "--moe-grouped-gemm"),
    "qwen3_30b_a3b": ("world=4 TP=2 PP=1 CP=1 EP=2 DP=2", "--group-query-attention"),
    "qwen2_57b_a14b": ("world=4 TP=1 PP=2 CP=1 EP=2 DP=2", "--group-query-attention"),
}


@pytest.fixture(scope="module")
def hf_line_data(line_data, tokenizer_flags, tmp_path_factory):
    """(data prefix, tokenizer directory): the session's one-line documents through the byte-level BPE as a
    HuggingFace tokenizer (enough documents that --split 99,1,0 and 99990,8,2 leave validation some)."""
    lines = os.path.join(os.path.dirname(line_data[0]), "lines.jsonl")
    flags = tokenizer_flags["HuggingFaceTokenizer"]
    prefix = str(tmp_path_factory.mktemp("hf_lines") / "lines")
    preprocess_tool.main(["--input", lines, *flags, "--output-prefix", prefix, "--append-eod"])
    return prefix + "_text_document", flags[-1]


def records(path) -> dict[int, dict]:
    """The training records of log.jsonl by iteration (validation's records aside)."""
    with open(path, encoding="utf-8") as stream:
        return {record["iteration"]: record for record in map(json.loads, stream) if "validation" not in record}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_family_script_trains_saves_and_resumes_as_written(name, hf_line_data, tmp_path):
    layout, startup_line = FAMILIES[name]
    out = tmp_path / "out"
    cmd = ["bash", os.path.join(SCRIPTS, f"{name}.sh"), str(out), hf_line_data[1], hf_line_data[0]]
    first = subprocess.run(cmd, env=job_env(), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    output = first.stdout + first.stderr
    assert first.returncode == 0, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    assert f"layout: {layout}" in output, output[-6000:]
    assert f"] {startup_line}" in output, output[-6000:]
    assert "trained 4 iterations in " in output, output[-6000:]
    assert re.search(r"validation.* at iteration 4\b", output), output[-6000:]
    checkpoints = out / "checkpoints" if name == "deepseek_v3" else out
    tensorboard = out / "tensorboard"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert list(tensorboard.glob("events.out.tfevents.*"))
    trained = records(tensorboard / "log.jsonl")
    assert all(trained[i]["lm loss"] == trained[i]["lm loss"] for i in range(1, 5))  # finite, not NaN

    # Resume from the save at iteration 2: iterations 3 and 4 again, to the same losses.
    shutil.rmtree(checkpoints / "iter_0000004")
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("2")
    (tensorboard / "log.jsonl").unlink()
    again = subprocess.run(cmd, env=job_env(), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-6000:]
    assert "(iteration 2," in output, output[-6000:]
    resumed = records(tensorboard / "log.jsonl")
    assert sorted(resumed) == [3, 4], output[-6000:]
    for i in (3, 4):
        assert resumed[i]["lm loss"] == trained[i]["lm loss"], (i, resumed[i], trained[i])
