"""The shared jobs themselves (`shared_jobs.py`, `job_runner.py`): parts of one world size run in one job, each
with its own arguments and a clean slate; a part that fails fails alone, and the parts after it still run. Run in
the background, as a session runs them: niced, apart from the foreground's launches, ended with the session."""

import time
from types import SimpleNamespace

import psutil
import pytest

from tests.distributed import conftest
from tests.distributed.launcher import descendants
from tests.distributed.shared_jobs import Part, PartFailed, SharedJobs, paused

PARTS = {
    "first": Part("job_probe_worker", "report", 2, ("first", "{data}", "{workdir}")),
    "second": Part("job_probe_worker", "report", 2, ("second", "{workdir}"), workdir="shared"),
    "third": Part("job_probe_worker", "report", 2, ("third",)),
    "broken": Part("job_probe_worker", "fail", 2, ("broken",)),
    "after": Part("job_probe_worker", "report", 2, ("after", "{workdir}"), workdir="shared"),
    "alone": Part("job_probe_worker", "report", 1, ("alone",)),
    "timed": Part("job_probe_worker", "report", 2, ("timed",), timed=True),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    jobs = SharedJobs(PARTS, {"data": "DATA"}, lambda key: str(tmp_path_factory.mktemp(key)))
    jobs.start()
    outcomes = {}
    for name in PARTS:
        try:
            outcomes[name] = jobs.result(name)
        except PartFailed as failure:
            outcomes[name] = failure
    return jobs, outcomes


def test_each_part_gets_its_own_arguments_and_directory(jobs):
    jobs, outcomes = jobs
    assert outcomes["first"]["args"] == ["first", "DATA", jobs.workdir("first")]
    assert outcomes["second"]["args"] == ["second", jobs.workdir("second")]
    assert jobs.workdir("second") == jobs.workdir("after") != jobs.workdir("first")
    assert outcomes["alone"] == {**outcomes["alone"], "args": ["alone"], "world": 1}


def test_parts_of_a_world_size_share_one_job_and_start_clean(jobs):
    _, outcomes = jobs
    assert outcomes["first"]["pid"] == outcomes["second"]["pid"] == outcomes["third"]["pid"]  # one set of ranks
    assert outcomes["first"]["world"] == outcomes["second"]["world"] == 2
    # the default group alone: what "first" left (megatron-core's groups, its own) was torn down
    assert (
        outcomes["first"]["groups_found"]
        == outcomes["second"]["groups_found"]
        == outcomes["third"]["groups_found"]
        == 1
    )
    # and their threads (the first part also started the default group's and torch's own, for good)
    assert outcomes["third"]["threads_found"] == outcomes["second"]["threads_found"]
    # and megatron-core's aux-loss scale a training run's schedule sets (moe_worker's layers read it)
    assert not any(outcomes[name]["aux_loss_scale_found"] for name in ("first", "second", "third"))


def test_the_session_summary_has_each_finished_parts_time_and_threads(jobs):
    jobs, outcomes = jobs
    assert set(jobs.timings) == {name for name, outcome in outcomes.items() if isinstance(outcome, dict)}
    assert "broken" not in jobs.timings
    assert all(secs > 0 and threads > 1 for secs, threads in jobs.timings.values())


def test_a_failing_part_fails_alone_and_the_rest_run_in_a_new_job(jobs):
    jobs, outcomes = jobs
    assert isinstance(outcomes["broken"], PartFailed)
    assert "part failed on purpose with ['broken']" in str(outcomes["broken"])
    assert outcomes["after"]["args"] == ["after", jobs.workdir("after")]
    assert outcomes["after"]["pid"] != outcomes["second"]["pid"]


def test_background_jobs_run_niced_and_marked_each_job_its_own_mark(jobs):
    _, outcomes = jobs
    reports = [outcomes[name] for name in ("first", "second", "third", "after", "alone")]
    assert all(report["niceness"] == 19 for report in reports)
    # each rank its own session's autogroup (torchrun's start_new_session): the group niced too, else the kernel
    # shares the cores between sessions as equals and the foreground's launches run half as fast
    assert all(report["autogroup"] is None or report["autogroup"].split()[-2:] == ["nice", "19"] for report in reports)
    marks = [report["background_job"] for report in reports]
    assert marks[0] == marks[1] == marks[2] and len(set(marks)) == 3 and None not in marks  # jobs: 2, 2 after, 1


def test_a_timed_part_runs_in_a_job_of_its_own_in_the_foreground(jobs):
    """Not niced, not marked, not in the background's job of its world size: its timings are the machine's."""
    _, outcomes = jobs
    timed = outcomes["timed"]
    assert timed["args"] == ["timed"] and timed["world"] == 2
    assert timed["niceness"] == psutil.Process().nice() and timed["background_job"] is None
    assert timed["pid"] not in {outcomes[name]["pid"] for name in ("first", "second", "third", "after")}


def test_a_background_job_is_not_the_foregrounds_pauses_and_stop_ends_it(tmp_path_factory):
    jobs = SharedJobs({"slow": Part("job_probe_worker", "sleep", 2, ("slow", "600"))}, {}, tmp_path_factory.mktemp)
    jobs.start()
    try:
        deadline, ranks = time.monotonic() + 120, []
        while len(ranks) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
            ranks = [psutil.Process(pid) for pid in descendants(jobs.running_job)] if jobs.running_job else []
            ranks = [proc for proc in ranks if "torch.distributed.run" not in proc.cmdline()]  # not torchrun
        assert len(ranks) == 2, ranks
        assert all(proc.nice() == 19 for proc in ranks)
        assert not {proc.pid for proc in ranks} & descendants()  # a foreground launch's leftover check passes them by
        with paused():  # a quiet_cores module: the job stopped, and going on after it
            assert all(proc.status() == psutil.STATUS_STOPPED for proc in ranks), [proc.status() for proc in ranks]
        assert not any(proc.status() == psutil.STATUS_STOPPED for proc in ranks)
    finally:
        jobs.stop()
    assert not psutil.wait_procs(ranks, timeout=10)[1]
    assert not descendants(jobs.running_job)
    with pytest.raises(PartFailed):
        jobs.result("slow")


def test_the_modules_that_read_shared_jobs_run_last_each_in_its_order():
    reads, other = SimpleNamespace(JOB_PARTS={"x": None}), SimpleNamespace()
    items = [SimpleNamespace(module=module, name=name) for module, name in
             [(reads, "r1"), (other, "o1"), (reads, "r2"), (other, "o2"), (None, "n1")]]  # fmt: skip
    conftest.pytest_collection_modifyitems(items)
    assert [item.name for item in items] == ["o1", "o2", "n1", "r1", "r2"]
