"""The cost model's profile of the running cluster: reused from disk when its fingerprint matches, else measured.

Inputs: `ProfileGroups`, `ProfileSettings`, a cache directory. Outputs: `obtain_profile` -> `Profile` (fits, path,
measured or not, why, the lines not trusted; `save` writes it once the run started); `load_or_measure` (tools: saves
at once); `describe_cluster` (the fingerprint). Invariant: rank 0 reads the file and decides, one broadcast gives
every rank the decision and the fits, so every rank holds the same lines; a line not to be trusted
(`profile_cache.fit_problems`) is measured once more. Collective: every rank calls these.
The measurement itself: `measure.py`; what it measures: `profile_settings.py`; both re-exported here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import socket
import subprocess
import time

import torch.distributed as dist

from megatron_moe.comm.profiling import (
    gather_group_ranks,
    gather_rank_facts,
    profile_barrier,
    share_profile_decision,
)
from megatron_moe.files import write_atomic
from megatron_moe.overlap.cost_model import (
    ClusterFits,
)
from megatron_moe.overlap.measure import DENSE_MEASURED, comm_calls, measure_fits, model_error, timed_ms
from megatron_moe.overlap.profile_cache import (
    CACHE_ENV,
    FitCheck,
    cache_path,
    code_version,
    differences,
    fit_problems,
    fits_table,
    newest_differs,
    table_path,
)
from megatron_moe.overlap.profile_settings import (
    DenseWork,
    ExpertWork,
    ProfileGroups,
    ProfileSettings,
    as_json,
    layer_profile_settings,
)
from megatron_moe.platform import current_platform, device_name

log = logging.getLogger(__name__)

DEFAULT_SETTINGS = ProfileSettings()
"""The settings a tool's profile takes unless it says (frozen: one shared value)."""

__all__ = [  # the profiling API: measured here, with what and how (profile_settings.py, measure.py)
    "DENSE_MEASURED",
    "DenseWork",
    "ExpertWork",
    "Profile",
    "ProfileGroups",
    "ProfileSettings",
    "comm_calls",
    "describe_cluster",
    "layer_profile_settings",
    "link_description",
    "load_or_measure",
    "log_fits",
    "measure_fits",
    "model_error",
    "obtain_profile",
    "timed_ms",
]


def describe_cluster(
    groups: ProfileGroups, settings: ProfileSettings, link: str | None = None, *, dtype: str | None = None
) -> dict:
    """What a saved profile must match to be reused (the fingerprint, `megatron_moe.overlap.profile_cache`): world
    size, group sizes, every rank's host name, node rank and ranks per node (torchrun's GROUP_RANK and
    LOCAL_WORLD_SIZE: an emulated cluster's nodes share one host name), the EP and ESP groups' ranks
    (--expert-placement moves them between nodes), backend, device type and name, the link (`link`, e.g. "tc 1
    Gbit/s" given by the caller, else each rank's `link_description`), the run's dtype, the settings (the
    measured shapes) and the code version. As JSON reads it back (lists, not tuples), so that it compares equal
    to a saved one. Collective: every rank calls it."""
    facts = gather_rank_facts(
        {
            "host": socket.gethostname(),
            "node": os.environ.get("GROUP_RANK"),
            "local_world": os.environ.get("LOCAL_WORLD_SIZE"),
            "device_name": device_name(),
            "link": link if link is not None else link_description(),
        }
    )
    return as_json(
        {
            "world": dist.get_world_size(),
            **groups.sizes(),
            "hosts": [fact["host"] for fact in facts],
            "nodes": [fact["node"] for fact in facts],
            "ranks_per_node": [fact["local_world"] for fact in facts],
            "ep_groups": gather_group_ranks(groups.ep),  # --expert-placement: which all-to-alls cross nodes
            "esp_groups": gather_group_ranks(groups.esp),
            "backend": dist.get_backend(),
            "device": current_platform().device.type,
            "device_name": sorted({fact["device_name"] for fact in facts}),
            "link": link if link is not None else sorted({fact["link"] for fact in facts}),
            "dtype": dtype,
            "settings": settings.to_json(),
            "code": code_version(),
        }
    )


LINK_INTERFACE_ENVS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def link_description() -> str:
    """This rank's link as far as the host tells: the root queueing discipline and speed of the interface
    NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME names (the emulated cluster's shaped links are a tbf qdisc with
    their rate; its handle and the interface's name are left out, they change from run to run), and NCCL's
    transport settings (NCCL_* but NCCL_DEBUG*). "default" when nothing is set."""
    parts = []
    iface = next((os.environ[name] for name in LINK_INTERFACE_ENVS if os.environ.get(name)), None)
    if iface:
        iface = iface.split(",")[0].lstrip("^=")
        try:
            with open(f"/sys/class/net/{iface}/speed") as stream:
                parts.append(f"speed {stream.read().strip()}")
        except OSError:
            pass
        if shutil.which("tc"):
            shown = subprocess.run(["tc", "qdisc", "show", "dev", iface], capture_output=True, text=True, timeout=5)
            root = next((line for line in shown.stdout.splitlines() if " root " in line), "")
            if root:
                parts.append(re.sub(r"^qdisc (\S+) \S+ root( refcnt \d+)?", r"\1", root.strip()))
    parts += sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("NCCL_") and "DEBUG" not in k)
    return "; ".join(parts) or "default"


def log_fits(fits: ClusterFits, source: str) -> None:
    """The fits, R^2 and points, one line per kind (rank 0: every rank holds the same)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    log.info("%s", fits_table(fits, source).rstrip())


@dataclasses.dataclass(kw_only=True)
class Profile:
    """The cost-model profile a run got (`obtain_profile`): the same on every rank."""

    fits: ClusterFits
    path: str | None
    """Where it was read, or is written by `save` (None: nowhere)."""
    measured: bool
    why: str
    """Why it was measured ("none saved at ...", "--cost-profile-remeasure", "the saved one differs in code,
    hosts"), or "the fingerprint matches"."""
    problems: dict[str, str]
    """Kind -> why its line is not to be trusted, after the one re-measure (empty: every line is trusted)."""
    seconds: float = 0.0
    """Spent measuring."""
    saved: bool = False

    @property
    def trusted(self) -> bool:
        return not self.problems

    def save(self) -> None:
        """Rank 0 writes a measured profile to `path` (atomically: tmp + rename), once; the caller calls it when
        the run has started (its first iteration done), so that a launch that fails earlier leaves no profile for
        the next run to reuse. An untrusted one too: the next run reads the same verdict from its points and
        takes the same defaults, without measuring (--cost-profile-remeasure tries again). Not collective."""
        if self.saved or not self.measured or self.path is None:
            return
        if dist.get_rank() == 0 and not _written(self.path, self.fits.save):
            self.path = None  # warned: not cached
        self.saved = True


UNREADABLE = "the saved one is unreadable"


def _written(path: str, write) -> bool:
    """`write(path)` into a cache directory made where missing; False, with one warning naming the directory,
    where it cannot be written (read-only, full, not a directory): the profile is then used, not cached."""
    try:
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        write(path)
        return True
    except OSError as error:
        where = os.path.dirname(path) or "."
        log.warning(
            "cost model: cannot write the profile cache %s (%s); the profile is used but not cached (give "
            "--cost-profile-cache or $%s a writable directory)",
            where,
            error.strerror or error,
            CACHE_ENV,
        )
        return False


def _saved_decision(path: str | None, description: dict, remeasure: bool) -> tuple[dict | None, str]:
    """Rank 0's decision: (the saved fits as JSON, why) to reuse them, (None, why) to measure."""
    if path is None:
        return None, "no profile file"
    if remeasure:
        return None, "--cost-profile-remeasure"
    if not os.path.exists(path):
        return None, f"none saved at {path}{newest_differs(os.path.dirname(path) or '.', description)}"
    try:
        saved = ClusterFits.load(path)
    except (OSError, ValueError, KeyError) as error:
        return None, f"{UNREADABLE} ({error}): ignored, measured again"
    changed = differences(saved.cluster, description)
    if changed:
        return None, f"the saved one differs in {', '.join(changed)}"
    return saved.to_json(), "the fingerprint matches"


def obtain_profile(
    path: str | None,
    groups: ProfileGroups,
    settings: ProfileSettings = DEFAULT_SETTINGS,
    *,
    cache_dir: str | None = None,
    link: str | None = None,
    dtype: str | None = None,
    remeasure: bool = False,
    check: FitCheck | None = None,
) -> Profile:
    """The cluster's profile: the one saved at `path` (None: in `cache_dir` under this cluster's fingerprint;
    both None: none) when its description is this run's, else measured, and once more where a line is not to
    be trusted (`Profile.problems`: the lines still not trusted, also of a saved one). Nothing is written here
    but the table beside `path` (rank 0, for people); `Profile.save` writes the profile. Every rank of the world
    calls it, and issues the same collectives: the description's gathers, rank 0's decision (one broadcast),
    then the benchmarks where measured."""
    check = check or FitCheck()
    description = describe_cluster(groups, settings, link, dtype=dtype)
    if path is None and cache_dir is not None:
        path = cache_path(cache_dir, description)
    decision = _saved_decision(path, description, remeasure) if dist.get_rank() == 0 else None
    saved, why = share_profile_decision(decision)
    if saved is not None:  # its lines are judged again (this run's --cost-profile-min-r2): the same on every rank
        fits = ClusterFits.from_json(saved)
        return Profile(fits=fits, path=path, measured=False, why=why, problems=fit_problems(fits, check))
    started = time.perf_counter()
    fits = measure_fits(groups, settings, cluster=description)
    problems = fit_problems(fits, check)
    if problems:  # agreed fits, so every rank takes this branch: measured once more
        why += f"; measured twice ({', '.join(problems)} unreliable the first time)"
        fits = measure_fits(groups, settings, cluster=description)
        problems = fit_problems(fits, check)
    profile = Profile(
        fits=fits, path=path, measured=True, why=why, problems=problems, seconds=time.perf_counter() - started
    )
    if path is not None and dist.get_rank() == 0:  # rank 0 alone writes, and alone reads `path` from here on
        if not _written(table_path(path), lambda table: write_atomic(table, fits_table(fits, f"measured: {why}"))):
            profile.path = None
    return profile


def load_or_measure(
    path: str | None,
    groups: ProfileGroups,
    settings: ProfileSettings = DEFAULT_SETTINGS,
    *,
    link: str | None = None,
) -> tuple[ClusterFits, bool]:
    """The tools' form (tools/profile_cluster.py, bench_pipeline.py): `obtain_profile` without the fit check,
    saved at once. The cluster's fits and whether they were measured now. Every rank of the world must call it."""
    profile = obtain_profile(path, groups, settings, link=link, check=FitCheck(min_r2=0.0))
    if profile.measured:
        profile.save()
        profile_barrier()  # the file is complete before any rank goes on (a later run's ranks read it)
    log_fits(profile.fits, f"measured, saved to {path}" if profile.measured else f"loaded from {path}")
    return profile.fits, profile.measured
