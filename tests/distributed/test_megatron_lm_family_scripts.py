"""Megatron-LM's DeepSeek-V3, DeepSeek-V2-Lite, Qwen3-30B-A3B and Qwen2-57B-A14B flags (examples/megatron_lm/, only
sizes, degrees and paths changed) train as written, each through its own torchrun line on CPU processes (gloo),
on tokenized data through a HuggingFace tokenizer: 4 iterations, validated and saved at 2 and 4. Resumed from the
save at 2, iterations 3 and 4 train to the same losses (this test found megatron-core 0.16.1 saving the distributed
optimizer's state of every parameter past the first gradient bucket as another's: the Patch
"reshardable_bucket_offsets", tests/unit/test_optimizer_checkpoint_state.py).

Their dry runs (the flag pass on the world each asks torchrun for) are tests/unit/test_megatron_lm_scripts.py."""

import json
import math
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


@pytest.fixture(scope="module")
def trained(hf_line_data, tmp_path_factory):
    """name -> (its command, its output folder, its checkpoint folder, its log.jsonl records): each script run once
    (4 iterations, validated and saved at 2 and 4), on first use."""
    runs = {}

    def run(name):
        if name not in runs:
            out = tmp_path_factory.mktemp(name) / "out"
            cmd = ["bash", os.path.join(SCRIPTS, f"{name}.sh"), str(out), hf_line_data[1], hf_line_data[0]]
            job = subprocess.run(cmd, env=job_env(), cwd=out.parent, capture_output=True, text=True, timeout=900)
            runs[name] = (cmd, out, job)
        return runs[name]

    return run


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_family_script_trains_validates_and_saves_as_written(name, trained):
    layout, startup_line = FAMILIES[name]
    _, out, first = trained(name)
    output = first.stdout + first.stderr
    assert first.returncode == 0, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    assert f"layout: {layout}" in output, output[-6000:]
    assert f"] {startup_line}" in output, output[-6000:]
    assert "trained 4 iterations in " in output, output[-6000:]
    assert re.search(r"validation.* at iteration 4\b", output), output[-6000:]
    checkpoints = out / "checkpoints" if name == "deepseek_v3" else out
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    losses = [record["lm loss"] for record in records(out / "tensorboard" / "log.jsonl").values()]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses), losses


def test_a_family_script_resumes_exactly_from_its_save_at_iteration_2(trained):
    cmd, out, first = trained("deepseek_v2_lite")
    assert first.returncode == 0, (first.stdout + first.stderr)[-6000:]
    tensorboard = out / "tensorboard"
    before = records(tensorboard / "log.jsonl")
    shutil.rmtree(out / "iter_0000004")
    (out / "latest_checkpointed_iteration.txt").write_text("2")
    (tensorboard / "log.jsonl").unlink()
    again = subprocess.run(cmd, env=job_env(), cwd=out.parent, capture_output=True, text=True, timeout=900)
    output = again.stdout + again.stderr
    assert again.returncode == 0 and "(iteration 2," in output, output[-6000:]
    resumed = records(tensorboard / "log.jsonl")
    assert sorted(resumed) == [3, 4], output[-6000:]
    assert [resumed[i]["lm loss"] for i in (3, 4)] == [before[i]["lm loss"] for i in (3, 4)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_family_scripts_checkpoint_exports_as_its_family(name, trained, megatron_world1, tmp_path, capsys):
    """What the script trained (its layout, 4 ranks) goes out to HuggingFace as its own family, checked by
    `export-hf`'s own logit comparison with transformers' class of it (issue 42)."""
    from tools.checkpoint import convert

    architecture = {"deepseek_v3": "DeepseekV3", "deepseek_v2_lite": "DeepseekV2", "qwen3_30b_a3b": "Qwen3Moe"}
    _, out, first = trained(name)
    assert first.returncode == 0, (first.stdout + first.stderr)[-6000:]
    checkpoints = out / "checkpoints" if name == "deepseek_v3" else out
    assert convert.main(["export-hf", "--load", str(checkpoints), "--save", str(tmp_path / "hf")]) == 0
    printed = capsys.readouterr().out
    assert f"({architecture.get(name, 'Qwen2Moe')}ForCausalLM)" in printed, printed
    diff = re.search(r"verify: max \|logits\(megatron_moe\) - logits\(transformers\)\| = (\S+)", printed)
    assert diff and float(diff.group(1)) < 1e-4, printed
