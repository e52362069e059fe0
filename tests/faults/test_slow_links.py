"""Slow is not dead, on the emulated cluster (tools/emulated_cluster.py): 2 nodes x 1 rank, the tiny MoE job with
short watchdog settings; its inter-node link throttled for a while (the peers alive, collectives completing
slowly), then cut.

    throttled (RATE_GBIT for THROTTLED_S): the job goes on, nobody is called dead, no "heartbeats off"
    link down:                             rank 0 names rank 1 within --dead-peer-seconds and ends the job; its
                                           --save lock is removed on the way out

Needs root, `ip` and `tc` (as tests/distributed/test_emulated_cluster.py): without them this fails naming what is
missing. Before: one store timeout switched the heartbeats off for good and rank 0 then ended the job calling the
slow rank 1 "stopped, hung or dead"; the link-down exit left the save lock.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

from tests.conftest import ROOT, load_tool
from tests.distributed.launcher import tiny_pretrain_command

cluster_tool = load_tool("emulated_cluster")
RATE_GBIT = float(os.environ.get("MEGATRON_MOE_TEST_SLOW_GBIT", "0.00025"))  # 250 kbit/s: ~10 s per gradient all-reduce
THROTTLED_S = 30
WATCHDOG = ("--stall-report-seconds", "2", "--dead-peer-seconds", "30", "--distributed-timeout-minutes", "1.5")


class Node:
    """One node's torchrun, its output collected by a thread."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def text(self, since: float = 0.0) -> str:
        return "".join(line for t, line in list(self.lines) if t >= since)

    def iterations(self) -> list[int]:
        return [int(m) for m in re.findall(r"iteration\s+(\d+)/", self.text())]


def test_a_throttled_link_is_slow_not_dead_and_a_cut_one_ends_the_job_cleanly(train_data, tmp_path):
    save = str(tmp_path / "ckpt")
    flags = ("--train-iters", "100000", "--lr", "1e-3", *WATCHDOG, "--save", save, "--save-interval", "100000")
    loopback = tiny_pretrain_command(train_data, *flags)
    script = next(i for i, word in enumerate(loopback) if word.endswith("pretrain_gpt_moe.py"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, MEGATRON_MOE_FORCE_CPU="1")
    with cluster_tool.EmulatedCluster(2, 1.0, burst="32kb") as cluster:  # a small bucket: the rate holds at once
        nodes = []
        for i in range(2):
            run = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={i}",
                f"--master-addr={cluster.address(0)}", "--master-port=29631", "--nproc-per-node=1", *loopback[script:],
            ]  # fmt: skip
            node_env = {**env, **cluster.node_env(i, 1, 29631)}
            nodes.append(
                Node(cluster.run_on(i, run, node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            )
        deadline = time.monotonic() + 240
        while max(nodes[1].iterations(), default=0) < 3:
            assert time.monotonic() < deadline and nodes[1].proc.poll() is None, (
                nodes[0].text()[-3000:] + nodes[1].text()[-3000:]
            )
            time.sleep(0.5)
        # 1. throttled: the peers are alive, each collective slow
        cluster.set_link_gbit(RATE_GBIT)
        throttled_at = time.monotonic()
        before = max(nodes[1].iterations())
        time.sleep(THROTTLED_S)
        slow_iterations = max(nodes[1].iterations()) - before
        cluster.set_link_gbit(1.0)
        time.sleep(5)
        during = nodes[0].text(throttled_at) + nodes[1].text(throttled_at)
        ours = "".join(line for line in during.splitlines(keepends=True) if re.search(r"\] rank \d: ", line))
        assert nodes[0].proc.poll() is None and nodes[1].proc.poll() is None, ours[-6000:]
        assert "stopped, hung or dead" not in during and "heartbeats off" not in during, during[-4000:]
        assert max(nodes[1].iterations()) > before, during[-4000:]
        # 2. link down: rank 1 is gone for rank 0
        subprocess.run(["ip", "-n", cluster.namespace(1), "link", "set", cluster.iface(1), "down"], check=True)
        cut_at = time.monotonic()
        nodes[0].proc.wait(timeout=120)
        ended_s = time.monotonic() - cut_at
        text0 = nodes[0].text(cut_at)
        report = [line for line in text0.splitlines() if "ending the job" in line]
    print(f"throttled {THROTTLED_S} s at {RATE_GBIT} Gbit/s: {slow_iterations} iterations; "
          f"link down: rank 0 ended the job after {ended_s:.0f} s")  # fmt: skip
    assert report and "ranks [1] sent no heartbeat for 30 s or more" in report[0], text0[-4000:]
    assert ended_s < 30 + 2 + 15, (ended_s, text0[-4000:])
    assert not os.path.exists(os.path.join(save, "megatron_moe.lock")), os.listdir(save)
