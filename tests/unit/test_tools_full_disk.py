"""The tools on a full disk or an unwritable output (issue 41, docs/troubleshooting.md "Directories, caches and
tools"): one line naming the file, exit code 2, nothing partial left (no half .bin / .idx, no `hf.tmp/`), no
`done:` printed when a file failed."""

import json
import os

import pytest

from megatron_moe.data import DataError
from tests.conftest import preprocess_tool
from tests.unit.unwritable import full, read_only


def one_word_documents(tmp_path, count):
    """A .jsonl of `count` one-word documents: a small .bin, an .idx of 20 bytes a document."""
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": "def"}) + "\n" for _ in range(count)))
    return str(source)


def preprocess(tokenizer, source, prefix):
    return preprocess_tool.main(
        ["--input", source, "--tokenizer-model", tokenizer.model_path, "--output-prefix", prefix, "--append-eod"]
    )


@pytest.mark.parametrize("documents, failing", [(1000, ".idx"), (20000, ".bin")])
def test_preprocess_on_a_full_disk_names_the_file_and_leaves_nothing(tokenizer, tmp_path, capsys, documents, failing):
    """1,000 documents: a 4 KB .bin fits in 12 KB, its 20 KB .idx does not (before: a 13-line traceback after
    `done:`); 20,000: the .bin does not."""
    source = one_word_documents(tmp_path, documents)
    with full(str(tmp_path / "out"), "12k") as out:
        prefix = os.path.join(out, "ds")
        with pytest.raises(DataError) as error:
            preprocess(tokenizer, source, prefix)
        assert os.listdir(out) == []  # no half .bin, .idx or temporary
    assert str(error.value) == (
        f"--output-prefix: cannot write {prefix}_text_document{failing}: No space left on device; free space there "
        f"or give a --output-prefix in a writable folder with room (nothing was written)"
    )
    assert "done:" not in capsys.readouterr().err


def test_preprocess_into_a_read_only_folder_names_the_file(tokenizer, tmp_path):
    source = one_word_documents(tmp_path, 10)
    with read_only(str(tmp_path / "out")) as out, pytest.raises(DataError) as error:
        preprocess(tokenizer, source, os.path.join(out, "ds"))
    assert str(error.value).startswith(f"--output-prefix: cannot write {out}/ds_text_document.bin: "), error.value
