"""The distributed tier's shared torchrun jobs (`shared_jobs.py`): the parts the selected tests' modules declare,
started in the background at the tier's first test where BACKGROUND_JOBS asks for it; the modules that read them
run last in the session."""

import json
import os
import string

import pytest

from tests.distributed.shared_jobs import SharedJobs

_SESSION_JOBS: list[SharedJobs] = []


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
    jobs = SharedJobs(parts, values, lambda key: str(tmp_path_factory.mktemp(key)))
    _SESSION_JOBS.append(jobs)
    yield jobs
    jobs.stop()


BACKGROUND_JOBS = "MEGATRON_MOE_TEST_BACKGROUND_JOBS"
"""Set to 1, the session starts the shared jobs in the background. Off by default: on this 2-core machine it cut
pytest from 1876 s to 1113-1453 s, but 3 of 4 clean-clone runs then failed a test that measures time (a cost
profile's model error, a clock-offset miss, a cost-model choice made on a profile measured niced)."""


@pytest.fixture(scope="session", autouse=True)
def shared_jobs_in_background(request):
    """The shared jobs, started with the tier's first test: the modules that read them come last (below), and the
    tests before them run while the jobs take the cores those tests leave idle."""
    if os.environ.get(BACKGROUND_JOBS) != "1":  # opt-in: see BACKGROUND_JOBS
        return
    if any(getattr(item.module, "JOB_PARTS", None) for item in request.session.items if hasattr(item, "module")):
        request.getfixturevalue("shared_jobs").start()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """The tests of modules that declare shared-job parts last, each module's in its order: the others run while
    the jobs do (`shared_jobs_in_background`)."""
    reads = [item for item in items if getattr(getattr(item, "module", None), "JOB_PARTS", None)]
    if reads:
        first = set(map(id, reads))
        items[:] = [item for item in items if id(item) not in first] + reads


def pytest_terminal_summary(terminalreporter):
    """Each shared-job part's time and rank 0's threads after it: where the tier's time goes, and a leak shows
    as a count that climbs from part to part."""
    timings = {name: took for jobs in _SESSION_JOBS for name, took in jobs.timings.items()}
    if timings:
        terminalreporter.section("shared torchrun jobs: seconds per part, threads after it")
        for name, (secs, threads) in sorted(timings.items(), key=lambda item: -item[1][0]):
            terminalreporter.write_line(f"{secs:8.1f} s  {threads:5d} threads  {name}")
