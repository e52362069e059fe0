"""Every tool's `--help` answers before torch or megatron-core load, and shows each flag's default.

Each tool runs as `python -m` would run it, in a fresh interpreter, with `--help`; at exit the interpreter reports
whether torch or megatron.core was imported, and which flags of the parsers the tool built have a default that
their help does not show. (How fast `--help` answers is not asserted: timing tests are not kept; the heavy
imports are what took seconds.)
"""

import glob
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tools.cli import HelpFormatter, shows_default

WORKERS = {"tools.bench_moe_layer_ep": "bench_moe_layer.py --cluster's torchrun worker: positional JSON, no flags"}
"""Modules whose `__main__` is another tool's worker, not a command line."""


def tool_modules() -> list[str]:
    """Every runnable tool: tools/*.py and tools/checkpoint/*.py with a `__main__` block (not a `WORKERS` one),
    and the trainer."""
    found = []
    for path in sorted(
        glob.glob(os.path.join(ROOT, "tools", "*.py")) + glob.glob(os.path.join(ROOT, "tools", "*", "*.py"))
    ):
        with open(path, encoding="utf-8") as f:
            if 'if __name__ == "__main__"' in f.read():
                found.append(os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, "."))
    return [module for module in found if module not in WORKERS] + ["pretrain_gpt_moe"]


PROBE = """
import argparse, atexit, json, runpy, sys
parsers = []
real = argparse.ArgumentParser.parse_known_args
def recording(self, *args, **kwargs):
    parsers.append(self)
    return real(self, *args, **kwargs)
argparse.ArgumentParser.parse_known_args = recording
def all_parsers():
    todo = list(parsers)
    while todo:
        parser = todo.pop()
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
def report():
    from tools.cli import shows_default
    hidden = []
    for parser in all_parsers():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or not shows_default(action):
                continue
            text = formatter._expand_help(action) if action.help is not None else ""
            if "default" not in text.lower() and "unset" not in text.lower():
                hidden.append(f"{parser.prog} {action.option_strings[0]} (default {action.default!r})")
    loaded = sorted({name for name in sys.modules if name == "torch" or name.startswith("megatron.core")})[:3]
    print("PROBE" + json.dumps({"parsers": len(parsers), "loaded": loaded, "hidden": hidden}), file=sys.stderr)
atexit.register(report)
sys.argv = [MODULE, "--help"]
runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
"""


def run_help(module: str) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.replace("MODULE", repr(module))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    probe = [line for line in proc.stderr.splitlines() if line.startswith("PROBE")]
    assert proc.returncode == 0 and probe, f"{module} --help: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(probe[-1][len("PROBE") :]), proc.stdout


@pytest.mark.slow  # a fresh interpreter per tool: ~0.5 s each, ~15 s in all
@pytest.mark.parametrize("module", tool_modules())
def test_help_answers_without_torch_and_shows_defaults(module):
    report, usage = run_help(module)
    assert report["parsers"] >= 1 and "usage:" in usage, (report, usage[:500])
    assert not report["loaded"], f"`python -m {module} --help` imported {report['loaded']} before answering"
    assert not report["hidden"], f"`python -m {module} --help` hides these defaults: {report['hidden']}"


def test_the_tools_are_found():
    modules = tool_modules()
    assert {"tools.preprocess_data", "tools.checkpoint.convert", "tools.plan_cluster", "pretrain_gpt_moe"} <= set(
        modules
    )
    assert "tools.benchlib" not in modules  # a library, no command line
    assert set(WORKERS) <= {os.path.relpath(p, ROOT)[:-3].replace(os.sep, ".") for p in glob.glob(f"{ROOT}/tools/*.py")}


def test_the_probe_sees_torch_and_a_hidden_default(tmp_path):
    """The check can fail: a tool that imports torch first and hides a default is reported as such."""
    (tmp_path / "heavy_tool.py").write_text(
        "import argparse\nimport torch\n"
        "if __name__ == '__main__':\n"
        "    p = argparse.ArgumentParser()\n"
        "    p.add_argument('--steps', type=int, default=7, help='how many')\n"
        "    p.parse_args()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.replace("MODULE", repr("heavy_tool"))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads([line for line in proc.stderr.splitlines() if line.startswith("PROBE")][-1][len("PROBE") :])
    assert report["loaded"] == ["torch"]
    assert report["hidden"] == ["heavy_tool.py --steps (default 7)"]


def test_the_formatter_shows_defaults_but_not_none_or_off_switches():
    import argparse

    parser = argparse.ArgumentParser(prog="t", formatter_class=HelpFormatter, description="line one\n  kept as is")
    parser.add_argument("--steps", type=int, default=7, help="how many")
    parser.add_argument("--name", help="unset by default")
    parser.add_argument("--fast", action="store_true", help="go fast")
    parser.add_argument("--size", type=int, default=3, help="size (default: three)")
    parser.add_argument("--keys", nargs="+", default=["text", "100%"], help="keys")
    text = parser.format_help()
    assert "how many (default: 7)" in text and "keys (default: text 100%)" in text
    assert "go fast\n" in text and "(default: False)" not in text and "(default: None)" not in text
    assert "size (default: three)\n" in text
    assert "  kept as is" in text
    assert [shows_default(a) for a in parser._actions] == [False, True, False, False, True, True]
