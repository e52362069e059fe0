"""The tools on bad input end in one line naming the file, what is wrong and what is valid, exit
code 2, and leave nothing written (tools/preprocess_data.py, tools/checkpoint/convert.py import-hf)."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # each case starts a tool in a fresh interpreter: ~5 s for preprocess_data


def run_tool(*command, cwd):
    python_path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))  # `-m tools.NAME` from cwd
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path)
    return subprocess.run([sys.executable, *command], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def preprocess(tokenizer, source, out):
    tool = ["-m", "tools.preprocess_data"]
    flags = ["--input", str(source), "--tokenizer-model", tokenizer.model_path, "--output-prefix", str(out / "ds")]
    return run_tool(*tool, *flags, "--append-eod", cwd=source.parent)


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "name, content, message",
    [
        (
            "latin1.jsonl",
            b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
            "not UTF-8 text: byte 28 (line 2) is 0xe9 (invalid continuation byte)",
        ),
        ("latin1.txt", b"line one\nna\xefve\n", "not UTF-8 text: byte 11 (line 2) is 0xef (invalid continuation byte)"),
    ],
)
def test_preprocess_names_the_first_byte_that_is_not_utf8(tokenizer, tmp_path, name, content, message):
    source = tmp_path / name
    source.write_bytes(content)
    out = tmp_path / "out"
    proc = preprocess(tokenizer, source, out)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_lines(proc.stderr) == [
        f"error: --input {source}: {message}; re-encode the file to UTF-8 (e.g. iconv -f latin1 -t utf-8 IN > OUT) "
        f"or leave it out of --input"
    ]
    assert not out.exists()  # no partial output, not even the folder


@pytest.mark.parametrize("content", [b"", b"\n  \n"])
def test_preprocess_refuses_input_without_documents(tokenizer, tmp_path, content):
    source = tmp_path / "empty.jsonl"
    source.write_bytes(content)
    (tmp_path / "out").mkdir()
    proc = preprocess(tokenizer, source, tmp_path / "out")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_lines(proc.stderr)[-1] == (
        f"error: --input {source}: no documents with tokens for --json-keys text (0 tokens from 0 "
        f"documents); give .jsonl lines with a non-empty 'text' string, or non-empty text files"
    )
    assert os.listdir(tmp_path / "out") == []  # the temporaries removed


@pytest.mark.parametrize(
    "config, message",
    [
        (
            None,
            "no config.json there; give an HF model directory of model_type 'mixtral', 'qwen2_moe', 'qwen3_moe', "
            "'deepseek_v2', 'deepseek_v3' (config.json, *.safetensors, tokenizer.model or tokenizer.json)",
        ),
        (
            '{"model_type": "mixtral",\n "hidden_size": 64,,}',
            "{dir}/config.json is not valid JSON (line 2 column "
            "20: Expecting property name enclosed in double quotes); give the config.json of an HF model",
        ),
        (
            '{"model_type": "llama"}',
            "{dir}/config.json has model_type='llama'; these import: 'mixtral', 'qwen2_moe', 'qwen3_moe', "
            "'deepseek_v2', 'deepseek_v3'",
        ),
        (
            '{"model_type": "deepseek_v3", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, '
            '"num_experts_per_tok": 2, "rope_scaling": {"type": "longrope"}}',
            "{dir}/config.json: rope_type='longrope': not supported (MLA here takes 'default' or 'yarn')",
        ),
        (
            '{"model_type": "mixtral", "hidden_size": 64}',
            "{dir}/config.json lacks 'num_attention_heads'; give the config.json of an HF Mixtral model",
        ),
    ],
)
def test_import_hf_names_the_config_file_and_writes_nothing(tmp_path, config, message):
    hf = tmp_path / "hf"
    hf.mkdir()
    if config is not None:
        (hf / "config.json").write_text(config)
    out = tmp_path / "ckpt"
    proc = run_tool(
        "-c", CONVERT_SAYING_IF_TORCH_LOADED, "import-hf", "--load", str(hf), "--save", str(out), cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_lines(proc.stderr) == [f"error: --load={hf}: {message.format(dir=hf)}"]
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # neither --save nor its .tmp
    assert proc.stdout.splitlines()[-1] == "torch loaded: False"  # refused before the heavy start-up (before: ~5 s)


CONVERT_SAYING_IF_TORCH_LOADED = (
    "import sys; from tools.checkpoint.convert import main; code = main(sys.argv[1:]); "
    "print('torch loaded:', 'torch' in sys.modules); sys.exit(code)"
)
"""tools/checkpoint/convert.py's main, then whether torch was imported (stdout's last line)."""
