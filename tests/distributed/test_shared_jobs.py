"""The shared jobs themselves (`shared_jobs.py`, `job_runner.py`): parts of one world size run in one job, each
with its own arguments and a clean slate; a part that fails fails alone, and the parts after it still run."""

import pytest

from tests.distributed.shared_jobs import Part, PartFailed, SharedJobs

PARTS = {
    "first": Part("job_probe_worker", "report", 2, ("first", "{data}", "{workdir}")),
    "second": Part("job_probe_worker", "report", 2, ("second", "{workdir}"), workdir="shared"),
    "third": Part("job_probe_worker", "report", 2, ("third",)),
    "broken": Part("job_probe_worker", "fail", 2, ("broken",)),
    "after": Part("job_probe_worker", "report", 2, ("after", "{workdir}"), workdir="shared"),
    "alone": Part("job_probe_worker", "report", 1, ("alone",)),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    jobs = SharedJobs(PARTS, {"data": "DATA"}, lambda key: str(tmp_path_factory.mktemp(key)))
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
