"""The cost-model profile a run can trust (megatron_moe/overlap/profile_cache.py, profiler.obtain_profile): its
fingerprint and cache, the check of its fits (a bad line is measured once more, then replaced by the defaults:
pipeline degree 1, with a warning naming it), the atomic write after the run started, a code-version mismatch."""

import json
import logging
import os

import pytest
import torch.distributed as dist

from megatron_moe.overlap import profile_cache, profiler
from megatron_moe.overlap.cost_model import ClusterFits, LinearFit, Schedule, fit_linear
from megatron_moe.overlap.profile_cache import FitCheck, fit_problems, usable_fits
from megatron_moe.overlap.profiler import ProfileGroups, obtain_profile
from megatron_moe.training.cost_profile import profile_line
from tests.unit.unwritable import read_only

KINDS = ("a2a", "ag", "rs", "ar", "gemm")


def line(*points, r2=None) -> LinearFit:
    fit = fit_linear(points)
    return fit if r2 is None else LinearFit(alpha=fit.alpha, beta=fit.beta, r2=r2, points=fit.points)


GOOD = line((1e5, 1.1), (2e5, 2.0), (4e5, 4.1))
FLAT = line((1e5, 2.00), (2e5, 2.06), (4e5, 1.97))  # R^2 near 0, every point within 3% of the line
NOISY = line((1e5, 1.0), (2e5, 9.0), (3e5, 1.5), (4e5, 8.0))  # the slope is noise's: points 60% off
NEGATIVE = LinearFit(alpha=-3.0, beta=1e-5, r2=0.99, points=((1e5, -1.9), (4e5, 1.1)))  # a profile made before nnls


def fits_with(**lines) -> ClusterFits:
    return ClusterFits(fits={**{kind: GOOD for kind in KINDS}, **lines}, model_error={"forward": 0.05})


# ------------------------------------------------------------------------------------------------- the fit check


def test_a_flat_line_with_low_r2_is_trusted_a_noisy_or_negative_one_is_not():
    assert FLAT.r2 < 0.5 and profile_cache.scatter(FLAT) < 0.05
    assert fit_problems(fits_with(a2a=FLAT)) == {}
    problems = fit_problems(fits_with(gemm=NOISY, ar=NEGATIVE))
    assert set(problems) == {"gemm", "ar"}
    assert problems["gemm"].startswith(f"R^2 {NOISY.r2:.2f}, points ") and "off the line" in problems["gemm"]
    assert problems["ar"].startswith("negative time -2 ms in its measured range"), problems["ar"]


def test_corrections_are_not_judged_by_their_r2():
    """The "chunk" lines are signed residuals: a -2 ms residual at every degree fits 0 with R^2 far below 0 (the
    -3.09 a user saw) and is no sign of a bad profile; nor is a large model error (the solver's least gain)."""
    residual = line((1, -2.0), (3, -2.5), (7, -1.8))
    assert residual.r2 < 0 and residual.alpha == residual.beta == 0.0
    unchunked = LinearFit(alpha=-2.6, beta=0.0, points=((0.0, -2.6),))
    fits = ClusterFits(fits=fits_with(chunk=residual, unchunked=unchunked).fits, model_error={"forward": 0.9})
    assert fit_problems(fits) == {}
    assert profile_cache.quality(fits).endswith("model error 90% (a degree > 1 must gain more)")


def test_hand_given_lines_and_an_off_check_are_not_judged():
    assert fit_problems(fits_with(ar=LinearFit(alpha=0.05, beta=2.5e-6))) == {}
    assert fit_problems(fits_with(gemm=NOISY), FitCheck(min_r2=0.0)) == {}  # --cost-profile-min-r2 0: no check
    assert fit_problems(fits_with(gemm=NOISY), FitCheck(min_r2=0.1)) == {}  # R^2 0.17: above the flag's threshold
    assert list(fit_problems(fits_with(gemm=NOISY), FitCheck(min_r2=0.2))) == ["gemm"]


def test_only_unreliable_dense_lines_leave_the_rest_usable():
    dense = {"attn": GOOD, "attn_bwd": NOISY, "mlp": GOOD}
    fits = fits_with(**dense)
    kept = usable_fits(fits, fit_problems(fits))
    assert kept is not None and kept.missing_dense() == ["attn", "mlp", "route", "unroute"] and "gemm" in kept.fits
    fits = fits_with(gemm=NOISY, **dense)
    assert usable_fits(fits, fit_problems(fits)) is None


# ----------------------------------------------------------------------------------- fingerprint, cache, version


def test_the_cache_file_is_the_fingerprints_and_changes_with_any_field(tmp_path):
    description = {"world": 2, "hosts": ["a", "a"], "dtype": "torch.float32", "code": {"source": "x"}}
    path = profile_cache.cache_path(str(tmp_path), description)
    assert path == profile_cache.cache_path(str(tmp_path), dict(reversed(description.items())))  # key order
    assert os.path.basename(path).startswith("cost_profile_") and path.endswith(".json")
    for key, value in (("world", 4), ("dtype", "torch.bfloat16"), ("code", {"source": "y"})):
        assert profile_cache.cache_path(str(tmp_path), {**description, key: value}) != path, key
    assert profile_cache.table_path(path) == path[: -len(".json")] + ".table.txt"
    assert profile_cache.differences(description, {**description, "world": 4, "link": "tbf"}) == ["link", "world"]


def test_the_cache_dir_defaults_under_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(profile_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert profile_cache.default_cache_dir() == str(tmp_path / "megatron_moe" / "cost_profiles")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert profile_cache.default_cache_dir() == os.path.expanduser("~/.cache/megatron_moe/cost_profiles")
    monkeypatch.setenv(profile_cache.CACHE_ENV, str(tmp_path / "ci"))
    assert profile_cache.default_cache_dir() == str(tmp_path / "ci" / "cost_profiles")


def test_the_code_version_hashes_the_profilers_and_the_models_source():
    version = profile_cache.code_version()
    assert set(version) == {"megatron_moe", "source"} and len(version["source"]) == 16
    assert "megatron_moe.overlap.profiler" in profile_cache.CODE_MODULES
    assert "megatron_moe.overlap.cost_model" in profile_cache.CODE_MODULES


# ---------------------------------------------------------------------------- obtain_profile on a one-rank world


@pytest.fixture
def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def measured(monkeypatch):
    """measure_fits replaced by the next of `measured.results` (the benchmarks need groups; the logic does not)."""

    class Measured:
        results: list[ClusterFits] = []
        calls = 0

    def fake(groups, settings, *, cluster=None):
        Measured.calls += 1
        fits = Measured.results.pop(0)
        return ClusterFits(fits=fits.fits, cluster=cluster, model_error=fits.model_error)

    monkeypatch.setattr(profiler, "measure_fits", fake)
    return Measured


def obtain(cache, **kw):
    return obtain_profile(None, ProfileGroups(), cache_dir=str(cache), dtype="torch.float32", **kw)


def test_a_bad_line_is_measured_again_then_left_unused_with_a_warning_naming_it(world, measured, tmp_path):
    measured.results = [fits_with(gemm=NOISY), fits_with(gemm=NOISY)]
    profile = obtain(tmp_path)
    assert measured.calls == 2 and profile.measured and set(profile.problems) == {"gemm"}
    assert "measured twice (gemm unreliable the first time)" in profile.why
    assert usable_fits(profile.fits, profile.problems) is None  # training: fits None -> every auto's default
    level, text = profile_line(profile, None)
    assert level == logging.WARNING and "gemm (R^2 " in text and "pipeline degree 1" in text and "\n" not in text
    assert text.startswith("cost model: measured twice, not to be trusted: gemm (R^2 0.17, points 68% off")
    assert os.path.exists(profile_cache.table_path(profile.path))  # the table, for people
    profile.save()  # with its verdict: the next run takes the same defaults without measuring
    again = obtain(tmp_path)
    assert not again.measured and measured.calls == 2 and set(again.problems) == {"gemm"}
    level, text = profile_line(again, None)
    assert level == logging.WARNING and text.startswith(f"cost model: the profile reused from {profile.path} is not")
    assert "--cost-profile-remeasure to measure again" in text
    assert obtain(tmp_path, check=FitCheck(min_r2=0.1)).trusted  # the verdict is this run's threshold's


def test_a_second_measure_that_is_good_is_trusted(world, measured, tmp_path):
    measured.results = [fits_with(a2a=NEGATIVE), fits_with()]
    profile = obtain(tmp_path)
    assert measured.calls == 2 and profile.trusted
    level, text = profile_line(profile, {1: Schedule(forward=3, backward=1, predicted_ms={}, case={})})
    assert level == logging.INFO and text.startswith("cost model: profile measured in ")
    assert "lowest R^2 " in text and "pipeline degrees 3/1 (forward/backward)" in text and "table: " in text


def test_written_only_when_started_then_reused_and_remeasured_on_request(world, measured, tmp_path):
    measured.results = [fits_with()]
    first = obtain(tmp_path)
    assert first.measured and not os.path.exists(first.path)  # a launch that fails now leaves no profile
    first.save()
    saved = ClusterFits.load(first.path)
    assert saved.cluster == first.fits.cluster and saved.cluster["code"] == profile_cache.code_version()
    assert saved.cluster["dtype"] == "torch.float32" and saved.cluster["world"] == 1
    second = obtain(tmp_path)
    assert not second.measured and second.why == "the fingerprint matches" and second.path == first.path
    assert second.fits.to_json() == saved.to_json() and measured.calls == 1
    _, text = profile_line(second, None)
    assert text.startswith(f"cost model: profile reused from {first.path} (the fingerprint matches;")
    measured.results = [fits_with(gemm=FLAT)]
    third = obtain(tmp_path, remeasure=True)
    assert third.measured and third.why == "--cost-profile-remeasure" and third.path == first.path


def test_a_profile_of_other_code_is_measured_again(world, measured, tmp_path):
    measured.results = [fits_with(), fits_with(), fits_with()]
    first = obtain(tmp_path)
    first.save()
    with open(first.path) as stream:
        data = json.load(stream)
    data["cluster"]["code"]["source"] = "0" * 16  # measured by another version of the profiler
    with open(first.path, "w") as stream:
        json.dump(data, stream)
    again = obtain_profile(first.path, ProfileGroups(), dtype="torch.float32")
    assert again.measured and again.why == "the saved one differs in code", again.why
    other_dtype = obtain_profile(first.path, ProfileGroups(), dtype="torch.bfloat16")
    assert other_dtype.measured and other_dtype.why == "the saved one differs in code, dtype"


def test_a_cache_without_this_fingerprint_says_what_the_newest_profile_differs_in(
    world, measured, tmp_path, monkeypatch
):
    measured.results = [fits_with(), fits_with()]
    obtain(tmp_path).save()
    monkeypatch.setattr(profiler, "code_version", lambda: {"megatron_moe": "0.2.0", "source": "0" * 16})  # upgraded
    again = obtain(tmp_path)
    assert again.measured and again.why == f"none saved at {again.path}; the newest profile there differs in code"


def test_the_write_is_atomic(world, measured, tmp_path, monkeypatch):
    measured.results = [fits_with()]
    profile = obtain(tmp_path)
    with open(profile.path, "w") as stream:
        stream.write("old")

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    path = profile.path
    profile.save()  # warned, not raised: a cache that cannot be written does not stop the run
    assert profile.path is None
    with open(path) as stream:
        assert stream.read() == "old"  # the old file whole, never a part
    table = profile_cache.table_path(path)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (path, table))  # no tmp left


# ------------------------------------------------------------------ a cache file of any content, an unwritable cache


@pytest.mark.parametrize(
    "content",
    [
        "null",
        "[]",
        '"text"',
        "{}",
        '{"format": 1, "fits": []}',
        '{"format": 1, "fits": {"a2a": null}}',
        "{",
        "\x00\xff",
    ],
)
def test_a_cache_file_of_any_content_is_warned_about_naming_it_and_measured_again(world, measured, tmp_path, content):
    """Valid JSON of the wrong shape (`null`, a list) raised AttributeError, unnamed, on every run until deleted."""
    measured.results = [fits_with(), fits_with()]
    path = profile_cache.cache_path(
        str(tmp_path), profiler.describe_cluster(ProfileGroups(), profiler.DEFAULT_SETTINGS, dtype="torch.float32")
    )
    with open(path, "w", encoding="latin-1") as stream:
        stream.write(content)
    profile = obtain(tmp_path)
    assert profile.measured and profile.path == path and profile.why.startswith(profiler.UNREADABLE), profile.why
    level, text = profile_line(profile, None)
    assert level == logging.WARNING and path in text and "\n" not in text and "measured again" in text, text
    profile.save()  # written over: the next run reuses it
    assert not obtain(tmp_path).measured and measured.calls == 1


def test_an_unwritable_cache_directory_is_warned_about_once_and_not_cached(world, measured, tmp_path, caplog):
    """A read-only cache directory raised a raw OSError (exit 1); now one warning naming it, the run goes on."""
    measured.results = [fits_with(), fits_with()]
    cache = str(tmp_path / "cache")
    with read_only(cache), caplog.at_level(logging.WARNING):
        profile = obtain(cache)
        profile.save()
        assert os.listdir(cache) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"cost model: cannot write the profile cache {cache} ("), (
        warnings
    )
    assert profile.measured and profile.path is None
    _, text = profile_line(profile, None)
    assert "saved to" not in text
    (tmp_path / "file").write_text("")  # a cache "directory" under a file: ENOTDIR, the same warning
    assert obtain(tmp_path / "file" / "cache").path is None
