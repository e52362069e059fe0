"""tools/preprocess_data.py reports progress on a corpus of any size: documents and bytes per second, the share
read and an ETA where the input's size is known, at most one line per interval, and a summary at the end."""

import json
import re

from megatron_moe.data import iter_documents, iter_sized_documents
from tests.conftest import preprocess_tool
from tools.preprocess_data import ProgressLog, input_bytes


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_lines_at_most_every_interval_with_rates_share_and_eta():
    clock, lines = FakeClock(), []
    progress = ProgressLog(total_bytes=10_000, interval_s=2.0, clock=clock, write=lines.append)
    for _ in range(7):  # 7 documents of 100 bytes in 1.75 s: under the interval, no line yet
        clock.now += 0.25
        progress.update(100)
    assert lines == []
    clock.now += 0.25
    progress.update(100)  # 2 s: one line
    assert lines == ["progress: 8 documents, 800 B (4.0 docs/s, 400 B/s); 8.0% of 10.0 kB, ETA 23s"]
    clock.now += 1.0
    progress.update(100)  # 1 s after the line: too soon for another
    assert len(lines) == 1
    clock.now += 1.0
    progress.update(100)
    assert lines[1] == "progress: 10 documents, 1.0 kB (2.5 docs/s, 250 B/s); 10.0% of 10.0 kB, ETA 36s"
    progress.finish()
    assert lines[2] == "done: 10 documents, 1.0 kB in 4s (2.5 docs/s, 250 B/s)"


def test_unknown_size_gives_rates_only_and_zero_interval_only_the_summary():
    clock, lines = FakeClock(), []
    progress = ProgressLog(total_bytes=None, interval_s=1.0, clock=clock, write=lines.append)
    for _ in range(3):
        clock.now += 1.0
        progress.update(2_500_000)
    assert lines[-1] == "progress: 3 documents, 7.5 MB (1.0 docs/s, 2.5 MB/s)"  # no share, no ETA
    quiet, silent = ProgressLog(total_bytes=100, interval_s=0, clock=clock, write=lines.append), len(lines)
    for _ in range(5):
        clock.now += 10.0
        quiet.update(10)
    assert len(lines) == silent
    quiet.finish()
    assert len(lines) == silent + 1 and lines[-1].startswith("done: 5 documents, 50 B in 50s")


def test_sized_documents_count_the_input_bytes(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    text = '{"text": "caf\\u00e9", "other": 1}\n\n{"text": "two"}\n'
    jsonl.write_text(text)
    plain = tmp_path / "b.txt"
    plain.write_text("héllo\n", encoding="utf-8")
    paths = [str(jsonl), str(plain)]
    sized = list(iter_sized_documents(paths, ["text"]))
    assert (
        [doc for doc, _ in sized]
        == list(iter_documents(paths, ["text"]))
        == [
            {"text": "café"},
            {"text": "two"},
            {"text": "héllo\n"},
        ]
    )
    assert [size for _, size in sized] == [34, 1 + 16, 7]  # the blank line counts with the next document
    assert sum(size for _, size in sized) == input_bytes(paths) == len(text) + 7
    assert input_bytes([str(jsonl), "/dev/null"]) is None  # not a regular file: no size, no ETA


def test_preprocess_prints_progress_and_a_summary(tokenizer, tmp_path, capsys):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(50)))
    flags = ["--input", str(source), "--tokenizer-model", tokenizer.model_path, "--output-prefix", str(tmp_path / "ds")]
    preprocess_tool.main([*flags, "--progress-seconds", "1e-9", "--log-interval", "5"])  # a line after every document
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "--log-interval 5: changes nothing here; progress lines come every 1e-09 s (--progress-seconds)"
    progress = [line for line in err if line.startswith("progress: ")]
    assert len(progress) >= 10, err
    pattern = r"progress: \d+ documents, [\d.]+ k?B \([\d,]+ docs/s, [\d.]+ [kMG]?B/s\); [\d.]+% of [\d.]+ kB, ETA \d+s"
    assert all(re.fullmatch(pattern, line) for line in progress), progress[:3]
    summary = [line for line in err if line.startswith("done: ")]
    assert len(summary) == 1 and summary[0].startswith(f"done: 50 documents, {source.stat().st_size / 1000:.1f} kB")
    preprocess_tool.main([*flags, "--progress-seconds", "0"])
    err = capsys.readouterr().err.splitlines()
    assert not [line for line in err if line.startswith("progress: ")] and [l for l in err if l.startswith("done: ")]
    assert not [line for line in err if line.startswith("--log-interval")], err  # not given: not named
