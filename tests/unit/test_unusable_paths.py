"""Directories, caches and tools (issue 41, docs/troubleshooting.md "Directories, caches and tools"): an unwritable
--save / --tensorboard-dir and an unreadable --load named by their flag in the flag pass (exit 2, before any
process group)."""

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

from megatron_moe.config import ConfigError, parse_and_validate
from tests.conftest import ROOT
from tests.unit.unwritable import read_only

BASE = ["--data-path", "d", "--tokenizer-model", "t.model", "--num-experts", "8"]


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir"])
def test_an_unwritable_output_directory_is_named_by_its_flag_in_the_flag_pass(tmp_path, flag):
    """Before: "flags OK", then a raw OSError on the save lock's or log.jsonl's path after start-up."""
    with read_only(str(tmp_path / "ro")) as ro:
        for path in (ro, os.path.join(ro, "run", "ckpt")):  # the directory, and one to be made inside it
            with pytest.raises(ConfigError) as error:
                parse_and_validate([*BASE, flag, path], 1)
            assert str(error.value) == (
                f"{flag}={path}: cannot write there: {ro} is on a read-only filesystem; give a writable directory"
            ) or "not writable by this user" in str(error.value), str(error.value)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=f"^{flag}=.*/file/x: cannot write there: .*/file is a file, not a dir"):
        parse_and_validate([*BASE, flag, str(tmp_path / "file" / "x")], 1)
    assert parse_and_validate([*BASE, flag, str(tmp_path / "new" / "dir")], 1) is not None  # made at start-up
    assert not (tmp_path / "new").exists()  # the check writes nothing


def test_an_unreadable_load_is_named_by_its_flag():
    """Root reads every directory: the check runs as `nobody` there (setpriv), else as this user."""
    with tempfile.TemporaryDirectory() as parent:  # /tmp's, reachable by `nobody` (pytest's tmp_path is not)
        os.chmod(parent, 0o755)
        check_unreadable_load(pathlib.Path(parent) / "ckpt")


def check_unreadable_load(load):
    load.mkdir()
    load.chmod(0o300)
    code = (
        "from megatron_moe.config import ConfigError, parse_and_validate\n"
        f"try: parse_and_validate({[*BASE, '--load', str(load)]!r}, 1); print('accepted')\n"
        "except ConfigError as error: print(error)"
    )
    command = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"--load={load}: cannot read it (permission denied); give a directory this user can read"
    )
    load.chmod(0o755)
    assert parse_and_validate([*BASE, "--load", str(load)], 1) is not None
