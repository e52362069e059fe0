"""A multi-node cluster on one host: one network namespace per node, nodes joined by shaped links.

Rehearse a multi-node job on a laptop before spending cluster time:

    python -m tools.emulated_cluster --nodes 2 --procs-per-node 1 --link-gbit 1 -- \\
        examples/pretrain_gpt_moe_tiny_cpu.sh --train-iters 20

runs the command once per node, inside that node's namespace, with the multi-node variables the examples read
(NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE) and GLOO_SOCKET_IFNAME. Ranks of one node talk over
its loopback (intra-node, fast); ranks of different nodes cross the node's link, limited to `--link-gbit`
(inter-node). Only bandwidth is emulated: this kernel has no netem, so per-message latency stays tiny.

Topology of one run (names carry the owner's pid and a per-process counter, so concurrent runs never collide):

    namespace mmc-PID-K-sw:  bridge brPIDkK, one port pPIDkKnI per node
    namespace mmc-PID-K-nI:  interface ePIDkKnI (the other end of pPIDkKnI), address 169.254.X.(I+1)/24,
                             `tc qdisc ... root tbf rate R`: node I's NIC

tbf shapes egress only: each node's *sends* are limited to R, as a NIC's transmit rate is. In an all-to-all every
node sends its share to every other node at once, so each node's outgoing bytes take bytes / R on its own link,
in parallel with the others'; what a node receives is limited by the senders' links.

The namespaces are deleted when the `EmulatedCluster` context ends, at interpreter exit, and on SIGTERM/SIGHUP
(turned into SystemExit so the context unwinds). A run killed with SIGKILL leaves them behind: the next run
removes every namespace whose owner pid is no longer alive. Needs root, `ip` and `tc` (Debian: iproute2).
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

from tools.cli import HelpFormatter

PREFIX = "mmc"
STALE = re.compile(rf"^{PREFIX}-(\d+)-\d+-(?:sw|n\d+)$")  # kept runs (mmc-keep-...) never match
STOP_GRACE_S = 5.0
_instances = itertools.count()  # per-process counter: two clusters of one process get distinct names


class ClusterError(RuntimeError):
    """A one-line reason the cluster cannot be built or run (the CLI prints it and exits 2)."""


def check_prerequisites() -> None:
    """Raise ClusterError naming what is missing: root, `ip`, `tc`."""
    if os.geteuid() != 0:
        raise ClusterError(
            f"the emulated cluster needs root (network namespaces, tc), but this runs as uid {os.geteuid()}: "
            "run it as root, e.g. with sudo"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"`{tool}` not found on PATH: install iproute2 (apt-get install iproute2)")


def _run(step: str, argv: list[str]) -> str:
    """Run one set-up command; a failure names the step and the command (the kernel may lack the feature)."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        reason = (proc.stderr or proc.stdout).strip().splitlines()
        raise ClusterError(f"{step} failed: `{' '.join(argv)}`: {reason[-1] if reason else proc.returncode}")
    return proc.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces of earlier runs whose owner pid is gone (a run killed by SIGKILL), after killing the
    processes left inside them; returns their names."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = STALE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            # Its owner died without teardown (SIGKILL): its nodes' processes may still run inside.
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


def stop_process_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group `proc` leads, then SIGKILL it after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    # The leader may be gone while others of its group (e.g. torchrun's workers) still run.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class EmulatedCluster:
    """`nodes` network namespaces on one bridge, each node's link limited to `link_gbit` Gbit/s.

    Use as a context manager: the namespaces exist inside the `with` block and are deleted at its end, also on an
    exception, SIGTERM or SIGHUP (and at interpreter exit). `keep=True` leaves them up (named mmc-keep-...,
    which the stale sweep never removes) for inspection; `delete_commands()` says how to remove them.
    `burst` and `latency` are tbf's (the verified recipe's values; a smaller latency is a shorter queue).
    """

    def __init__(
        self, nodes: int, link_gbit: float, *, keep: bool = False, burst: str = "256kb", latency: str = "100ms"
    ):
        if nodes < 1 or nodes > 250:
            raise ClusterError(f"--nodes: {nodes} is out of range; give 1 to 250")
        if not link_gbit > 0:
            raise ClusterError(f"--link-gbit: {link_gbit} must be a positive rate in Gbit/s, e.g. 1 or 0.5")
        self.nodes, self.link_gbit, self.keep, self.burst, self.latency = nodes, link_gbit, keep, burst, latency
        pid, k = os.getpid(), next(_instances)
        self.tag = f"{PREFIX}-keep-{pid}-{k}" if keep else f"{PREFIX}-{pid}-{k}"
        self.switch = f"{self.tag}-sw"
        self.bridge = f"br{pid}k{k}"
        self.subnet = 1 + (pid * 7 + k) % 254  # 169.254.X.0/24 with X in 1..254, varies per run
        if len(f"p{self.bridge[2:]}n{nodes - 1}") > 15:  # the kernel's limit on interface names
            raise ClusterError(f"--nodes: {nodes} nodes make interface names over 15 characters; give fewer")
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict = {}

    # ---- names and addresses
    def namespace(self, i: int) -> str:
        return f"{self.tag}-n{i}"

    def iface(self, i: int) -> str:
        """Node i's interface inside its namespace (at most 15 characters, the kernel's limit)."""
        return f"e{self.bridge[2:]}n{i}"

    def address(self, i: int) -> str:
        return f"169.254.{self.subnet}.{i + 1}"

    def namespaces(self) -> list[str]:
        return list(self._made)

    def delete_commands(self) -> list[str]:
        return [f"ip netns del {name}" for name in reversed(self._made)]

    # ---- life cycle
    def __enter__(self) -> EmulatedCluster:
        check_prerequisites()
        remove_stale_namespaces()
        self._install_handlers()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _netns_add(self, name: str) -> None:
        _run("creating a network namespace", ["ip", "netns", "add", name])
        self._made.append(name)

    def _build(self) -> None:
        self._netns_add(self.switch)
        _run("creating a bridge", ["ip", "-n", self.switch, "link", "add", self.bridge, "type", "bridge"])
        _run("bringing the bridge up", ["ip", "-n", self.switch, "link", "set", self.bridge, "up"])
        for i in range(self.nodes):
            ns, iface, port = self.namespace(i), self.iface(i), f"p{self.bridge[2:]}n{i}"
            self._netns_add(ns)
            _run("bringing loopback up", ["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(
                "creating a veth pair",
                ["ip", "link", "add", iface, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch],
            )
            _run(
                "attaching a port to the bridge", ["ip", "-n", self.switch, "link", "set", port, "master", self.bridge]
            )
            _run("bringing a bridge port up", ["ip", "-n", self.switch, "link", "set", port, "up"])
            _run("addressing a node", ["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", iface])
            _run("bringing a node's link up", ["ip", "-n", ns, "link", "set", iface, "up"])
            self._shape("add", i, self.link_gbit)

    def _shape(self, verb: str, i: int, link_gbit: float) -> None:
        """`tc qdisc VERB ... tbf` on node i's interface: its egress (what the node sends) limited to link_gbit."""
        rate = f"{max(1, round(link_gbit * 1e6))}kbit"
        tbf = ["tbf", "rate", rate, "burst", self.burst, "latency", self.latency]
        tc = ["tc", "qdisc", verb, "dev", self.iface(i), "root", *tbf]
        _run(f"shaping a node's link (tc tbf, {verb})", ["ip", "netns", "exec", self.namespace(i), *tc])

    def set_link_gbit(self, link_gbit: float) -> None:
        """Change every node's link rate in place (no rebuild), e.g. to alternate rates within one test."""
        for i in range(self.nodes):
            self._shape("change", i, link_gbit)
        self.link_gbit = link_gbit

    def close(self) -> None:
        """Stop every process started with `run_on`, then delete the namespaces (unless kept). Idempotent."""
        for sig in self._old_handlers:
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C/SIGTERM must not cut teardown short
        for proc in self._procs:
            stop_process_group(proc)
        self._procs.clear()
        if not self.keep:
            for name in reversed(self._made):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            self._made.clear()
        self._restore_handlers()
        atexit.unregister(self.close)

    def _install_handlers(self) -> None:
        """SIGTERM/SIGHUP unwind the `with` block (SystemExit), so teardown runs; SIGINT raises KeyboardInterrupt,
        also where this process inherited it ignored (started by `nohup ... &` or any shell's background job: Python
        then leaves it ignored, and a SIGINT would leave the nodes running)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def unwind(signum, _frame):
            raise SystemExit(128 + signum)

        self._old_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, unwind)

    def _restore_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # ---- running commands on nodes
    def node_env(self, i: int, procs_per_node: int = 1, master_port: int = 29500) -> dict[str, str]:
        """The launch variables of node i (examples/common.sh reads them) and gloo's interface."""
        return {
            "NNODES": str(self.nodes),
            "NODE_RANK": str(i),
            "MASTER_ADDR": self.address(0),
            "MASTER_PORT": str(master_port),
            "GPUS_PER_NODE": str(procs_per_node),
            "GLOO_SOCKET_IFNAME": self.iface(i),
        }

    def run_on(self, i: int, argv: list[str], env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
        """Start `argv` inside node i's namespace, in its own process group; `close()` stops it if still running."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(i), *argv], env=env, start_new_session=True, **popen
        )
        self._procs.append(proc)
        return proc


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell exit status (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def tail(path: str, lines: int = 20) -> str:
    with open(path, errors="replace") as stream:
        return "".join(deque(stream, maxlen=lines))


def _pump(stream, log_path: str, prefix: str | None) -> None:
    """Copy a node's output to its log file, and to our stdout with `prefix` when the node is streamed."""
    with open(log_path, "wb") as log:
        for line in iter(stream.readline, b""):
            log.write(line)
            log.flush()
            if prefix is not None:
                sys.stdout.buffer.write(prefix.encode() + line)
                sys.stdout.flush()
    stream.close()


def start_nodes(cluster, argv, procs_per_node, master_port, log_dir, streamed) -> tuple[dict, dict, list]:
    """Start `argv` on every node. Node 0 writes to our stdout; node i > 0 to log_dir/node{i}.log, also to our
    stdout (each line prefixed "[node i] ") when i is in `streamed`. Returns (procs, log paths, pump threads)."""
    procs, logs, pumps = {}, {}, []
    for i in range(cluster.nodes):
        env = {**os.environ, **cluster.node_env(i, procs_per_node, master_port)}
        if i == 0:
            procs[i] = cluster.run_on(i, argv, env)
            continue
        logs[i] = os.path.join(log_dir, f"node{i}.log")
        procs[i] = cluster.run_on(i, argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        prefix = f"[node {i}] " if i in streamed else None
        pumps.append(threading.Thread(target=_pump, args=(procs[i].stdout, logs[i], prefix), daemon=True))
        pumps[-1].start()
    return procs, logs, pumps


def wait_nodes(procs: dict) -> dict[int, int]:
    """Wait for every node; when one fails, stop the others. Returns {node: exit code} of the nodes that ended
    by themselves (a node stopped here is left out: its code says nothing about the run)."""
    codes: dict[int, int] = {}
    while len(codes) < len(procs):
        for i, proc in procs.items():
            if i not in codes and proc.poll() is not None:
                codes[i] = exit_code(proc.returncode)
        failed = [i for i, code in codes.items() if code != 0]
        if failed:
            for i, proc in procs.items():
                if i not in codes:
                    message = f"node {failed[0]} failed (exit {codes[failed[0]]}); stopping node {i}"
                    print(f"emulated cluster: {message}", file=sys.stderr, flush=True)
                    stop_process_group(proc)
            break
        time.sleep(0.1)
    return codes


def run_command(cluster, argv: list[str], procs_per_node: int, master_port: int, streamed=()) -> int:
    """Run `argv` once per node (see `start_nodes` for where the output goes). When a node fails, stop the
    others. Returns the worst exit code among the nodes that ended by themselves."""
    log_dir = tempfile.mkdtemp(prefix="emulated_cluster-")
    print(
        f"emulated cluster: {cluster.nodes} nodes x {procs_per_node} processes, links {cluster.link_gbit} Gbit/s, "
        f"master {cluster.address(0)}:{master_port}; nodes 1.. log to {log_dir}",
        file=sys.stderr,
        flush=True,
    )
    procs, logs, pumps = start_nodes(cluster, argv, procs_per_node, master_port, log_dir, streamed)
    codes = wait_nodes(procs)
    for pump in pumps:
        pump.join(timeout=STOP_GRACE_S)
    for i in sorted(codes):
        if codes[i] != 0 and i in logs:
            message = f"node {i} exited {codes[i]}; last lines of {logs[i]}:\n{tail(logs[i])}"
            print(f"emulated cluster: {message}", file=sys.stderr, flush=True)
    return max(codes.values(), default=0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        description="Run COMMAND once per emulated node (a network namespace with a shaped link) on this host.",
        usage="%(prog)s --nodes N --procs-per-node K --link-gbit R [--keep] [--master-port P] [--stream-node I] "
        "-- COMMAND...",
    )
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes (network namespaces)")
    parser.add_argument("--procs-per-node", type=int, required=True, help="GPUS_PER_NODE given to the command")
    parser.add_argument("--link-gbit", type=float, required=True, help="each node's link rate, Gbit/s (egress)")
    parser.add_argument("--keep", action="store_true", help="leave the namespaces up afterwards")
    parser.add_argument("--master-port", type=int, default=29500, help="MASTER_PORT (node 0's namespace)")
    parser.add_argument(
        "--stream-node",
        type=int,
        action="append",
        help="also stream this node's output, lines prefixed [node I] (repeatable; default: the last node, "
        "where the trainer's last rank logs); every node > 0 also logs to a file",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command run on every node")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no COMMAND: give it after --, e.g. -- examples/pretrain_gpt_moe_tiny_cpu.sh")
    if args.procs_per_node < 1:
        parser.error(f"--procs-per-node: {args.procs_per_node} must be at least 1")
    streamed = args.stream_node if args.stream_node is not None else [args.nodes - 1] * (args.nodes > 1)
    if any(not 0 <= i < args.nodes for i in streamed):
        parser.error(f"--stream-node: {streamed} names a node outside 0..{args.nodes - 1}")
    args.stream_node = streamed
    if not 1 <= args.master_port <= 65535:
        parser.error(f"--master-port: {args.master_port} is not a TCP port; give 1 to 65535, e.g. 29500")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with EmulatedCluster(args.nodes, args.link_gbit, keep=args.keep) as cluster:
            code = run_command(cluster, args.command, args.procs_per_node, args.master_port, args.stream_node)
            if args.keep:
                print(
                    f"emulated cluster: kept namespaces {' '.join(cluster.namespaces())}\n"
                    f"  enter node 0:  ip netns exec {cluster.namespace(0)} bash\n"
                    f"  delete them:   {'; '.join(cluster.delete_commands())}",
                    file=sys.stderr,
                )
            return code
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"emulated cluster: interrupted; nodes stopped{'' if args.keep else ', namespaces removed'}",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints where every thread of the tool is (a stuck stop)
    sys.exit(main())
