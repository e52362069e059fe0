"""tools/emulated_cluster.py: nodes as network namespaces joined by shaped links.

The tool gives every node its launch variables, returns the worst exit code, stops the other nodes when one
fails, and removes every namespace it made: after a normal run, a failing node, SIGTERM/SIGINT/SIGHUP, and (by
the next run's sweep) SIGKILL. Its errors are one line. A 2-node gloo all-to-all across it takes the time the link
needs (tools/bench_link.py calibrates the achieved rate: never tc's), and training across it gives the losses of
the same run on loopback. Needs root, `ip` and `tc`: without them these tests fail, naming what is missing.
"""

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import ROOT, load_tool
from tests.distributed.launcher import tiny_pretrain_command

cluster_tool = load_tool("emulated_cluster")
link_tool = load_tool("bench_link")  # imports emulated_cluster: the module loaded above
TOOL = os.path.join(ROOT, "tools", "emulated_cluster.py")
STOPPED_WITHIN_S = 8.0


def namespaces(pattern: str) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if re.match(pattern, line)]


def running(cmdline: list[str]) -> list[int]:
    """Pids of live (not zombie) processes whose command line is exactly `cmdline`."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["cmdline"] == cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc.pid)
    return found


def start_tool(*args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, TOOL, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        **popen,
    )


def ended_or_fail(tool: subprocess.Popen, sleeper: list[str], after: str, timeout_s: float = 30.0) -> None:
    """Wait for `tool` to end; else fail saying where its threads are (its SIGUSR1 dump), whether it is still
    alive and which of its nodes' `sleeper`s are left (one left holds the tool's pipes open)."""
    try:
        tool.communicate(timeout=timeout_s)
        return
    except subprocess.TimeoutExpired:
        pass
    alive, left = tool.poll() is None, running(sleeper)
    if alive:
        tool.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    tool.kill()
    _, err = tool.communicate(timeout=10)
    pytest.fail(f"the tool did not end {timeout_s:.0f} s after {after}: alive {alive}, sleepers left {left}; "
                f"its stderr:\n{err[-6000:]}")  # fmt: skip


def wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the emulated cluster to come up"
        time.sleep(0.1)


def test_the_tool_can_run_here():
    """Root, `ip` and `tc` are there: every other test here needs them (a clear failure, not a silent skip)."""
    cluster_tool.check_prerequisites()


def test_each_node_gets_its_launch_variables_its_own_shaped_link_and_everything_is_torn_down(tmp_path):
    report = (
        f"env | grep -E '^(NNODES|NODE_RANK|MASTER_ADDR|MASTER_PORT|GPUS_PER_NODE|GLOO_SOCKET_IFNAME)=' "
        f"> {tmp_path}/node$NODE_RANK; ip -br -4 addr show dev $GLOO_SOCKET_IFNAME >> {tmp_path}/node$NODE_RANK; "
        f"tc qdisc show dev $GLOO_SOCKET_IFNAME >> {tmp_path}/node$NODE_RANK; "
        f"ip netns identify >> {tmp_path}/node$NODE_RANK"
    )
    args = ["--nodes", "3", "--procs-per-node", "2", "--link-gbit", "0.5", "--master-port", "29611"]
    tool = start_tool(*args, "--", "sh", "-c", report)
    out, err = tool.communicate(timeout=60)
    assert tool.returncode == 0, err
    assert namespaces(rf"{cluster_tool.PREFIX}-(keep-)?{tool.pid}-") == [], "namespaces left after a normal exit"
    nodes = [open(tmp_path / f"node{i}").read().splitlines() for i in range(3)]
    envs = [dict(line.split("=", 1) for line in lines if "=" in line) for lines in nodes]
    master = envs[0]["MASTER_ADDR"]
    assert re.fullmatch(r"169\.254\.\d+\.1", master), master
    for i, (env, lines) in enumerate(zip(envs, nodes)):
        assert (env["NNODES"], env["NODE_RANK"], env["MASTER_PORT"], env["GPUS_PER_NODE"]) == (
            "3",
            str(i),
            "29611",
            "2",
        )
        assert env["MASTER_ADDR"] == master
        address = master.rsplit(".", 1)[0] + f".{i + 1}/24"
        assert any(line.startswith(env["GLOO_SOCKET_IFNAME"]) and address in line for line in lines), lines
        assert any("tbf" in line and "rate 500Mbit" in line for line in lines), lines
        assert lines[-1] == f"{cluster_tool.PREFIX}-{tool.pid}-0-n{i}", lines  # its own namespace
    assert len({env["GLOO_SOCKET_IFNAME"] for env in envs}) == 3


def test_a_failing_node_stops_the_others_and_its_exit_code_is_returned():
    sleeper = ["sleep", "61.25"]
    command = f'if [ "$NODE_RANK" = 1 ]; then echo node-one-fails; exit 3; fi; exec {" ".join(sleeper)}'
    started = time.monotonic()
    tool = start_tool("--nodes", "2", "--procs-per-node", "1", "--link-gbit", "1", "--", "sh", "-c", command)
    out, err = tool.communicate(timeout=60)
    assert tool.returncode == 3, (out, err)
    assert time.monotonic() - started < STOPPED_WITHIN_S, "node 0's sleep was not stopped at once"
    assert "stopping node 0" in err and "node 1 exited 3" in err and "node-one-fails" in err, err
    assert "[node 1] node-one-fails" in out, out  # the last node is streamed
    assert running(sleeper) == []
    assert namespaces(rf"{cluster_tool.PREFIX}-{tool.pid}-") == []


@pytest.mark.parametrize("inherited", ["default", "ignored"])
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signal_to_the_tool_stops_the_nodes_and_tears_down(sig, code, inherited):
    """Also where the tool inherits SIGINT ignored, as every command a shell starts in the background does
    (`nohup make test &` left the tool running 30 s after a SIGINT, its nodes with it)."""
    sleeper = ["sleep", f"62.{int(sig)}"]
    disposition = signal.SIG_DFL if inherited == "default" else signal.SIG_IGN
    tool = start_tool(
        "--nodes", "2", "--procs-per-node", "1", "--link-gbit", "1", "--", *sleeper,
        preexec_fn=lambda: signal.signal(signal.SIGINT, disposition),
    )  # fmt: skip
    wait_until(lambda: len(running(sleeper)) == 2)
    assert len(namespaces(rf"{cluster_tool.PREFIX}-{tool.pid}-")) == 3  # switch + 2 nodes
    signalled = time.monotonic()
    tool.send_signal(sig)
    ended_or_fail(tool, sleeper, f"{sig.name}")
    assert time.monotonic() - signalled < STOPPED_WITHIN_S
    assert tool.returncode == code
    assert running(sleeper) == []
    assert namespaces(rf"{cluster_tool.PREFIX}-{tool.pid}-") == []


def test_after_sigkill_the_next_run_removes_the_namespaces_and_their_processes():
    sleeper = ["sleep", "63.5"]
    tool = start_tool("--nodes", "2", "--procs-per-node", "1", "--link-gbit", "1", "--", *sleeper)
    wait_until(lambda: len(running(sleeper)) == 2)
    tool.kill()
    tool.wait(timeout=10)  # not communicate(): the orphaned nodes still hold its pipes
    tool.stdout.close()
    tool.stderr.close()
    left = namespaces(rf"{cluster_tool.PREFIX}-{tool.pid}-")
    assert len(left) == 3, left  # SIGKILL cannot be handled: they stay until the next run
    with cluster_tool.EmulatedCluster(1, 1.0):
        assert namespaces(rf"{cluster_tool.PREFIX}-{tool.pid}-") == []
        wait_until(lambda: running(sleeper) == [], timeout_s=5)


def test_keep_leaves_the_namespaces_up_and_says_how_to_delete_them():
    tool = start_tool("--nodes", "2", "--procs-per-node", "1", "--link-gbit", "1", "--keep", "--", "true")
    out, err = tool.communicate(timeout=60)
    assert tool.returncode == 0, err
    kept = namespaces(rf"{cluster_tool.PREFIX}-keep-{tool.pid}-")
    try:
        assert len(kept) == 3, kept
        with cluster_tool.EmulatedCluster(1, 1.0):  # the stale sweep leaves kept namespaces alone
            assert len(namespaces(rf"{cluster_tool.PREFIX}-keep-{tool.pid}-")) == 3
        delete = re.search(r"delete them:\s+(.*)", err).group(1)
        subprocess.run(delete, shell=True, check=True)
        assert namespaces(rf"{cluster_tool.PREFIX}-keep-{tool.pid}-") == []
    finally:
        for name in kept:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def one_line_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def test_errors_are_one_line_naming_what_is_missing(tmp_path, monkeypatch, capsys):
    argv = ["--nodes", "2", "--procs-per-node", "1", "--link-gbit", "1", "--", "true"]
    # not root
    with monkeypatch.context() as patch:
        patch.setattr(cluster_tool.os, "geteuid", lambda: 1000)
        assert cluster_tool.main(argv) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "needs root" in line and "uid 1000" in line, line
    # no `ip`, then no `tc`
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = subprocess.run([sys.executable, TOOL, *argv], capture_output=True, text=True, env={"PATH": str(bin_dir)})
    assert tool.returncode == 2 and "`ip` not found" in one_line_error(tool.stderr) and "iproute2" in tool.stderr
    os.symlink(subprocess.run(["which", "ip"], capture_output=True, text=True).stdout.strip(), bin_dir / "ip")
    tool = subprocess.run([sys.executable, TOOL, *argv], capture_output=True, text=True, env={"PATH": str(bin_dir)})
    assert tool.returncode == 2 and "`tc` not found" in one_line_error(tool.stderr) and "iproute2" in tool.stderr
    # a kernel without tbf: the step and the command are named, and what was built is removed
    fake_tc = bin_dir / "tc"
    fake_tc.write_text("#!/bin/sh\necho 'Error: Specified qdisc kind is unknown.' >&2\nexit 2\n")
    fake_tc.chmod(0o755)
    tool = start_tool(*argv, env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    _, err = tool.communicate(timeout=60)
    line = one_line_error(err)
    assert tool.returncode == 2 and "shaping a node's link (tc tbf, add) failed" in line, line
    assert "tc qdisc add dev" in line and "qdisc kind is unknown" in line, line
    assert namespaces(rf"{cluster_tool.PREFIX}-{tool.pid}-") == []
    # bad values name the flag, the value and a valid choice
    for bad, expected in [
        (["--nodes", "2", "--procs-per-node", "1", "--link-gbit", "0", "--", "true"], "--link-gbit: 0.0 must be"),
        (["--nodes", "0", "--procs-per-node", "1", "--link-gbit", "1", "--", "true"], "--nodes: 0 is out of range"),
    ]:
        assert cluster_tool.main(bad) == 2
        line = one_line_error(capsys.readouterr().err)
        assert expected in line, line


def test_a_two_node_all_to_all_sees_both_ranks_and_takes_the_time_the_link_needs():
    """2x bytes take 2x the time, half the link rate 2x the time (within 20%), at a rate calibrated here: the median
    of 9 calls per size of the transport's all-to-all (tools/bench_link.py)."""
    sizes_mib, rate_gbit = (8, 16), 0.5
    with cluster_tool.EmulatedCluster(2, rate_gbit) as cluster:
        full = link_tool.calibrate(rate_gbit, sizes_mib, 9, cluster)
        half = link_tool.calibrate(rate_gbit / 2, sizes_mib, 9, cluster)
    for run in (full, half):
        assert run["world"] == 2 and run["ranks"] == [0, 1], run
        # The link is what limits the call: never above tc's rate, and not far below it (~0.95 here).
        assert 0.7 < run["fraction_of_tc"] < 1.05, run
        small, large = run["ms"]
        assert 2 * 0.8 < large / small < 2 * 1.2, f"2x bytes took {large / small:.2f}x the time: {run}"
    for fast_ms, slow_ms in zip(full["ms"], half["ms"]):
        assert 2 * 0.8 < slow_ms / fast_ms < 2 * 1.2, f"half the rate took {slow_ms / fast_ms:.2f}x: {full} {half}"


# --log-format json: each logged iteration's record, its losses and norms at full precision
ITERATION = re.compile(r'\{"iteration": (\d+), "train_iters".*?"lm loss": ([^,}]+).*?"grad_norm": ([^,}]+)')


def test_training_across_the_emulated_nodes_gives_the_losses_of_loopback(train_data):
    """The same 2-rank EP=2 run, on loopback and across 2 nodes' shaped link: the same losses
    and grad norms, bit for bit (the wire changes nothing but time)."""
    loopback = tiny_pretrain_command(train_data, "--train-iters", "10", "--log-format", "json")
    script = next(i for i, word in enumerate(loopback) if word.endswith("pretrain_gpt_moe.py"))
    on_node = [
        "sh",
        "-c",
        'exec "$0" -m torch.distributed.run --nnodes="$NNODES" --node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR" '
        '--master-port="$MASTER_PORT" --nproc-per-node="$GPUS_PER_NODE" "$@"',
        sys.executable,
        *loopback[script:],
    ]
    cluster = [sys.executable, TOOL, "--nodes", "2", "--procs-per-node", "1", "--link-gbit", "1", "--", *on_node]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, MEGATRON_MOE_FORCE_CPU="1")
    logs = {}
    for name, cmd in (("loopback", loopback), ("cluster", cluster)):
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert run.returncode == 0, f"{name} run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        logs[name] = [match.groups() for match in ITERATION.finditer(run.stdout + run.stderr)]
    assert [step for step, _, _ in logs["loopback"]] == [str(i) for i in range(1, 11)], logs["loopback"]
    assert logs["cluster"] == logs["loopback"]
