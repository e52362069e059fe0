"""A newcomer's path (issue 41, docs/troubleshooting.md "Directories, caches and tools"): the README says at the
top to activate `.venv` (Megatron-LM's scripts call a bare `torchrun`); its multi-node rehearsal has a run
directory of its own (in the demo's it resumed the demo's checkpoint at iteration 200: "trained 0 iterations")."""

import os
import re

from tests.conftest import ROOT


def readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as stream:
        return stream.read()


def test_the_readme_says_to_activate_the_venv_before_its_first_command():
    text = readme()
    first_command = text.index("```bash")
    assert 0 <= text.find("source .venv/bin/activate") < first_command


def test_the_rehearsals_run_directory_is_not_the_demos():
    for name in ("README.md", os.path.join("docs", "multi-node.md")):
        with open(os.path.join(ROOT, name), encoding="utf-8") as stream:
            text = " ".join(stream.read().split())
        commands = re.findall(r"python -m tools\.emulated_cluster [^`]*?pretrain_gpt_moe_tiny_cpu\.sh", text)
        assert commands, name
        for command in commands:
            run_dir = re.search(r"RUN_DIR=(\S+)", command)
            assert run_dir and "gpt_moe_tiny_cpu" not in run_dir.group(1), (name, command)
