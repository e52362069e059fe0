"""The distributed tier's shared torchrun jobs (`shared_jobs.py`): the parts the selected tests' modules declare."""

import json
import string

import pytest

from tests.distributed.shared_jobs import SharedJobs


@pytest.fixture(scope="session")
def shared_jobs(request, tmp_path_factory):
    modules = dict.fromkeys(item.module for item in request.session.items if getattr(item, "module", None))
    parts = {name: part for module in modules for name, part in getattr(module, "JOB_PARTS", {}).items()}
    used = {field for part in parts.values() for arg in part.args for _, field, _, _ in string.Formatter().parse(arg)}
    values = {}
    if used & {"data", "tokenizer"}:
        values["data"], values["tokenizer"] = request.getfixturevalue("train_data")
    if "tokenizer_runs" in used:
        values["tokenizer_runs"] = str(tmp_path_factory.mktemp("tokenizer_runs") / "runs.json")
        with open(values["tokenizer_runs"], "w") as f:
            json.dump(request.getfixturevalue("tokenizer_train_data"), f)
    return SharedJobs(parts, values, lambda key: str(tmp_path_factory.mktemp(key)))
