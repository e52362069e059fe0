"""The data a run trains on, end to end on real jobs: a resume after the prefix was rebuilt in place is refused
naming the prefix and what changed (exit 2), and goes on with --allow-data-change; a .bin whose token ids exceed
the vocabulary, without a PREFIX.meta.json, is one line naming the file before training (exit 2).

    A  2 ranks: iterations 1-2 on the prefix, saved
    (the prefix is rebuilt in place from fewer documents)
    B  1 rank: resumes A                          -> refused, exit 2    } at once
    C  1 rank: resumes A with --allow-data-change -> trains 3-4, exit 0 }
    D  1 rank: a copy of the data, one token beyond the vocabulary, no sidecar -> refused, exit 2

Before (run on main): B resumed on the new data without a word (exit 0); C's flag did not exist (exit 2); D
trained without a word (exit 0: no batch of its 2 steps held the token; one that does fails with
`IndexError: index out of range in self`, a traceback per rank).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy
import pytest

from tests.conftest import VOCAB, preprocess_tool
from tests.distributed.launcher import tiny_pretrain_command
from tests.faults.jobs import error_lines, job, rank_tracebacks, tiny_job, worker_failed


def one_rank_job(data, *flags: str):
    """A 1-rank job of the tiny MoE on `data` ((prefix, tokenizer)): half a 2-rank job's start-up."""
    cmd = tiny_pretrain_command(data, *flags)
    cmd[cmd.index("--nproc-per-node=2")] = "--nproc-per-node=1"
    cmd[cmd.index("--expert-model-parallel-size") + 1] = "1"
    return job(cmd)


@pytest.fixture(scope="module")
def jobs(corpus, train_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("data_change")
    output, model = str(root / "data"), train_data[1]
    preprocess_tool.main(["--input", corpus[0], "--tokenizer-model", model, "--output-prefix", output, "--append-eod"])
    prefix, save = output + "_text_document", str(root / "ckpt")
    with tiny_job((prefix, model), "--train-iters", "2", "--save", save) as a:
        assert a.finish(timeout=300) == 0, a.tail()
    fewer = root / "fewer.jsonl"
    fewer.write_text("".join(json.dumps({"text": text}) + "\n" for text in corpus[1][: len(corpus[1]) // 2]))
    preprocess_tool.main(["--input", str(fewer), "--tokenizer-model", model, "--output-prefix", output, "--append-eod"])

    beyond = str(root / "beyond")
    for suffix in (".bin", ".idx"):  # no .meta.json, as Megatron-LM's preprocess_data.py leaves data
        shutil.copyfile(train_data[0] + suffix, beyond + suffix)
    tokens = numpy.memmap(beyond + ".bin", dtype=numpy.uint16, mode="r+")
    tokens[len(tokens) // 3] = VOCAB + 100
    tokens.flush()
    del tokens

    resume = ("--train-iters", "4", "--load", save)
    with (
        one_rank_job((prefix, model), *resume) as b,
        one_rank_job((prefix, model), *resume, "--allow-data-change") as c,
        one_rank_job((beyond, model), "--train-iters", "2") as d,
    ):
        for ended in (b, c, d):
            ended.finish(timeout=300)
    return {"prefix": prefix, "save": save, "beyond": beyond, "B": b, "C": c, "D": d}


def test_a_resume_on_data_rebuilt_in_place_is_refused_naming_the_prefix_and_the_change(jobs):
    b, prefix = jobs["B"], jobs["prefix"]
    assert b.proc.returncode != 0 and worker_failed(b.text, 2), b.tail()
    (line,) = [line for line in error_lines(b.text) if "the data differs from the checkpoint's" in line]
    assert f"--load={os.path.join(jobs['save'], 'iter_0000002')}: the data differs" in line, line
    assert f"--data-path {prefix}: .bin bytes " in line and "documents " in line, line
    assert line.endswith("add --allow-data-change if the change is intended"), line
    assert rank_tracebacks(b.text) == 0 and not b.losses(), b.tail()


def test_allow_data_change_resumes_with_the_change_listed(jobs):
    c = jobs["C"]
    assert c.proc.returncode == 0, c.tail()
    assert f"resuming on other data (--allow-data-change): --data-path {jobs['prefix']}: .bin bytes" in c.text
    assert sorted(c.losses()) == [3, 4], c.tail()


def test_token_ids_beyond_the_vocabulary_are_one_line_before_training(jobs):
    d, beyond = jobs["D"], jobs["beyond"]
    assert d.proc.returncode != 0 and worker_failed(d.text, 2), d.tail()
    expected = f"tokenizer vocabulary ({VOCAB}) smaller than the data's token ids (max {VOCAB + 100}) in {beyond}.bin"
    assert any(expected in line for line in error_lines(d.text)), d.tail()
    assert "IndexError" not in d.text and rank_tracebacks(d.text) == 0 and not d.losses(), d.tail()
