"""Benchmarks on an emulated cluster: a worker script run under torchrun on every node, its JSON collected.

The driver side (`run_job`) starts `python -m torch.distributed.run ... SCRIPT ARGS` once per node of an
`EmulatedCluster` (tools/emulated_cluster.py), inside that node's namespace, with the node's launch variables and
gloo's interface; one rank of the job writes its result with `write_result` (worker side) to the file the driver
reads. Each node's output goes to a log file whose last lines a failure names. Used by tools/bench_step.py and
tools/bench_moe_layer.py's `--cluster` mode, so neither launches workers in its own way.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from megatron_moe.files import write_json_atomic
from tools.emulated_cluster import EmulatedCluster, stop_process_group, tail

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_ENV = "BENCH_RESULT"
KEEP_LOGS_ENV = "BENCH_KEEP_LOGS"
"""A directory: every job's node logs are copied there (`job<port>_node<i>.log`), to read the plan and timer lines."""
JOB_TIMEOUT_S = 600
_ports = itertools.count(29400)  # a fresh master port per job: the last job's sockets may linger in TIME_WAIT


def parse_cluster(spec: str) -> tuple[int, int]:
    """`NxK` -> (N nodes, K processes per node); a clear error naming the flag otherwise."""
    nodes, _, procs = spec.partition("x")
    if not (nodes.isdigit() and procs.isdigit() and int(nodes) >= 1 and int(procs) >= 1):
        raise ValueError(f"--cluster: {spec!r} is not NODESxPROCS; give e.g. 2x1 or 2x2")
    return int(nodes), int(procs)


def check_layouts_and_rates(parser, clusters: list[str], rates: list[float], layouts) -> None:
    """The flags every cluster benchmark takes: each `--cluster` one of `layouts`, each `--link-gbit` positive
    (`parser.error` names the flag, the value and a valid choice)."""
    for spec in clusters:
        if spec not in layouts:
            parser.error(f"--cluster: {spec} is not a layout here; give one of {', '.join(layouts)}")
    if any(not rate > 0 for rate in rates):
        parser.error(f"--link-gbit: {rates} must be positive rates in Gbit/s, e.g. 0.5 1 2.5")


def torchrun_argv(cluster: EmulatedCluster, node: int, procs_per_node: int, port: int, script: list[str]):
    """torchrun of `script` (a path and its arguments) as node `node` of `cluster`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={cluster.nodes}",
        f"--node-rank={node}",
        f"--nproc-per-node={procs_per_node}",
        f"--master-addr={cluster.address(0)}",
        f"--master-port={port}",
        *script,
    ]


def run_job(cluster: EmulatedCluster, procs_per_node: int, script: list[str], *, timeout_s: float = JOB_TIMEOUT_S):
    """Run `script` under torchrun on every node of `cluster`, `procs_per_node` ranks each (one torch thread
    per rank: the ranks share this host's cores); returns what the job's `write_result` wrote. A node that
    fails, or a job past `timeout_s`, stops the others and raises RuntimeError with the nodes' last lines."""
    port = next(_ports)
    with tempfile.TemporaryDirectory(prefix="benchcluster-") as tmp:
        result = os.path.join(tmp, "result.json")
        python_path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
        procs, logs = [], []
        for i in range(cluster.nodes):
            env = {
                **os.environ,
                **cluster.node_env(i, procs_per_node, port),
                "OMP_NUM_THREADS": "1",
                "MEGATRON_MOE_FORCE_CPU": os.environ.get("MEGATRON_MOE_FORCE_CPU", "1"),
                "PYTHONPATH": python_path,
                RESULT_ENV: result,
            }
            logs.append(os.path.join(tmp, f"node{i}.log"))
            with open(logs[-1], "wb") as log:
                argv = torchrun_argv(cluster, i, procs_per_node, port, script)
                procs.append(cluster.run_on(i, argv, env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        failure = _wait_all(procs, time.monotonic() + timeout_s)
        if failure is None and not os.path.exists(result):
            failure = "the job wrote no result"
        if failure is not None:
            for proc in procs:
                stop_process_group(proc)
            last = "\n".join(f"--- node {i} ({logs[i]}):\n{tail(logs[i], 15)}" for i in range(cluster.nodes))
            raise RuntimeError(f"benchmark job {' '.join(script[:2])} failed: {failure}\n{last}")
        if os.environ.get(KEEP_LOGS_ENV):
            os.makedirs(os.environ[KEEP_LOGS_ENV], exist_ok=True)
            for i, path in enumerate(logs):
                shutil.copyfile(path, os.path.join(os.environ[KEEP_LOGS_ENV], f"job{port}_node{i}.log"))
        with open(result) as stream:
            return json.load(stream)


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> str | None:
    """None when every node exited 0; otherwise why the job failed (a node's exit code, or the timeout)."""
    while True:
        codes = [proc.poll() for proc in procs]
        bad = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
        if bad:
            return f"node {bad[0][0]} exited {bad[0][1]}"
        if all(code == 0 for code in codes):
            return None
        if time.monotonic() > deadline:
            return "timed out"
        time.sleep(0.2)


def write_result(result) -> None:
    """Worker side: write `result` (JSON-serializable) where the driver reads it. Call on one rank only."""
    write_json_atomic(os.environ[RESULT_ENV], result)  # the driver never reads half a file
