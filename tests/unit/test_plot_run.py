"""tools/plot_run.py: a run's event files, written as training writes them (training/tensorboard_tags.py's
`Dashboard`), to a one-page PNG; a directory without events refused with a clear message."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from megatron_moe.config.parallel_dims import ParallelDims
from megatron_moe.training.comm_report import HEADLINE_FIGURES
from megatron_moe.training.tensorboard_tags import Dashboard, TagLayout, expert_load_tag, tag_of
from tools import plot_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_run(log_dir: str, steps: int = 6) -> None:
    """A short EP=2 run's events: loss, validation, throughput, two MoE layers' expert loads (expert 3 of layer 1
    idle), exposed communication of two kinds."""
    from torch.utils.tensorboard import SummaryWriter

    board = Dashboard(SummaryWriter(log_dir), layout=TagLayout(dims=ParallelDims(world=2, ep=2), moe=True))
    for step in range(1, steps + 1):
        comm = {"comm/exposed_ms/a2a_dispatch": 2.0 + step, "comm/exposed_ms/dp_grad_reduce": 1.0}
        board.scalars({"lm loss": 8.0 - step, "tokens-per-sec": 1000.0, **comm}, step, samples=8 * step)
        board.expert_loads({1: [10.0, 20.0, 2.0 * step, 0.0], 3: [8.0, 8.0, 8.0, 8.0]}, step, scalar_layers=4)
    board.scalars({"lm loss validation": 2.5}, steps, samples=8 * steps)
    board.close()


def png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    return struct.unpack(">II", head[16:24])


def test_a_run_renders_to_a_one_page_png(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    write_run(str(run / "tensorboard"))
    out = str(tmp_path / "summary.png")
    assert plot_run.main([str(run), "--out", out]) == out  # the run directory: its tensorboard/ found
    assert os.path.getsize(out) > 10_000
    assert png_size(out) == (1200, 900)  # 12 x 9 inches at --dpi 100


def test_what_the_page_reads(tmp_path):
    write_run(str(tmp_path))
    scalars = plot_run.read_scalars(plot_run.event_source(str(tmp_path)))
    loads = plot_run.expert_loads(scalars)
    assert sorted(loads) == [1, 3]
    steps, rows = loads[1]
    assert steps == [1, 2, 3, 4, 5, 6] and len(rows) == 4  # the idle expert kept, at 0
    assert rows[3] == [0.0] * 6 and rows[0][0] == pytest.approx(10.0 / 8.0)  # layer 1's mean at step 1: 32 / 4
    assert loads[3][1] == [[1.0] * 6] * 4  # balanced
    assert sorted(plot_run.exposed_by_kind(scalars)) == ["a2a_dispatch", "dp_grad_reduce"]
    assert plot_run.VALIDATION in scalars and plot_run.TOKENS_PER_S in scalars


def test_the_tags_read_are_the_tags_training_writes():
    assert plot_run.LOSS == tag_of("lm loss") and plot_run.VALIDATION == tag_of("lm loss validation")
    assert plot_run.TOKENS_PER_S == tag_of("tokens-per-sec")
    assert plot_run.EXPERT_LOAD.match(expert_load_tag(12, 3)).groups() == ("012", "003")
    assert "exposed_ms" in HEADLINE_FIGURES and plot_run.EXPOSED.match("comm/exposed_ms/pp_p2p")


def test_a_directory_without_events_is_refused_clearly(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        plot_run.main([str(tmp_path), "--out", str(tmp_path / "x.png")])
    assert "no TensorBoard event files" in str(exit_.value) and str(tmp_path) in str(exit_.value)
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(SystemExit, match="does not exist"):
        plot_run.main([str(tmp_path / "nowhere")])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SystemExit, match="not a TensorBoard event file"):
        plot_run.main([str(tmp_path / "notes.txt")])


def test_two_runs_below_the_path_are_refused_naming_them(tmp_path):
    for name in ("a", "b"):
        write_run(str(tmp_path / name), steps=1)
    with pytest.raises(SystemExit, match="holds the events of 2 runs"):
        plot_run.main([str(tmp_path)])


def test_without_matplotlib_it_says_how_to_install_it(tmp_path, monkeypatch):
    write_run(str(tmp_path), steps=1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit, match=r"pip install matplotlib"):
        plot_run.main([str(tmp_path), "--out", str(tmp_path / "x.png")])


def test_help_imports_neither_torch_nor_matplotlib():
    code = "import json, sys, tools.plot_run as p; p.build_parser().format_help(); print(json.dumps(list(sys.modules)))"
    modules = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = set(json.loads(modules.stdout))
    assert not loaded & {"torch", "matplotlib", "tensorboard", "megatron"}, loaded & {"torch", "matplotlib"}
