"""A throwaway Slurm cluster on this host: munged, slurmctld and two pretend nodes (n1, n2).

Everything it starts lives under one temporary directory (config, state,
spool, logs, pid files, its own munge socket and key) and listens on free
ports, so it neither needs nor disturbs a cluster already running here.
Clients reach it through $SLURM_CONF (see `env()`); daemons run in the
foreground as children of this process and are stopped by PID.
Debian's slurmctld, slurmd and munge, installed when missing (`install`); see docs/testing.md.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import psutil

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = (
    "/usr/sbin/slurmctld",
    "/usr/sbin/slurmd",
    "/usr/sbin/munged",
    "/usr/bin/sbatch",
    "/usr/bin/scontrol",
    "/usr/bin/sinfo",
    "/usr/bin/srun",
)
NODES = ("n1", "n2")


class Unavailable(RuntimeError):
    """Slurm cannot run on this machine (not root, no apt-get, install failed); the reason is the message."""


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def install() -> str:
    """Make sure Debian's Slurm and MUNGE are installed; returns what was done. Raises Unavailable."""
    if os.geteuid() != 0:
        raise Unavailable("needs root to install and run the Slurm daemons")
    if all(os.access(path, os.X_OK) for path in BINARIES) and _user_exists("munge"):
        return "already installed"
    if shutil.which("apt-get") is None:
        raise Unavailable("apt-get not found: cannot install slurmctld, slurmd, slurm-client, munge")
    install_cmd = ["apt-get", "-o", "DPkg::Lock::Timeout=120", "install", "-y", "--no-install-recommends", *PACKAGES]
    try:
        result = _run(install_cmd, timeout=600)
        if result.returncode != 0:  # e.g. an empty package list on a fresh image: update, then retry
            update = _run(["apt-get", "-o", "DPkg::Lock::Timeout=120", "update"], timeout=300)
            if update.returncode != 0:
                raise Unavailable(f"apt-get update failed (no network?): {update.stderr.strip()[-500:]}")
            result = _run(install_cmd, timeout=600)
    except subprocess.TimeoutExpired as error:
        raise Unavailable(f"{' '.join(error.cmd)} timed out after {error.timeout} s") from None
    if result.returncode != 0:
        raise Unavailable(f"apt-get install {' '.join(PACKAGES)} failed: {result.stderr.strip()[-500:]}")
    return "installed " + " ".join(PACKAGES)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def free_ports(count: int) -> list[int]:
    """Distinct ports nothing listens on now (held open together so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _traversable_tmp() -> str:
    """$TMPDIR when every directory above it lets other users through, else /tmp."""
    path = os.path.realpath(tempfile.gettempdir())
    probe = path
    while True:
        if not os.stat(probe).st_mode & 0o001:
            return "/tmp"
        if probe == os.path.dirname(probe):
            return path
        probe = os.path.dirname(probe)


class SlurmCluster:
    """Start with `start()`, always `stop()` (idempotent); `env()` for sbatch/scontrol."""

    def __init__(self, cpus_per_node: int = 2, memory_mb: int = 2000):
        self.cpus_per_node, self.memory_mb = cpus_per_node, memory_mb
        # Not pytest's tmp_path (mode 0700): munged runs as the munge user and must traverse the path.
        self.root = tempfile.mkdtemp(prefix="megatron-moe-slurm-", dir=_traversable_tmp())
        os.chmod(self.root, 0o755)
        self.conf = os.path.join(self.root, "slurm.conf")
        self.munge_dir = os.path.join(self.root, "munge")
        self.socket = os.path.join(self.munge_dir, "munge.socket")
        self.daemons: dict[str, subprocess.Popen] = {}
        self.started = time.time()

    # ------------------------------------------------------------ set-up

    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=self.conf)

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def write_config(self) -> None:
        ctld_port, *node_ports = free_ports(1 + len(NODES))
        for name in ("state", "spool", "log", "run"):
            os.makedirs(self.path(name))
        nodes = "\n".join(
            f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={self.cpus_per_node} RealMemory={self.memory_mb} State=UNKNOWN"
            for node, port in zip(NODES, node_ports)
        )
        with open(self.conf, "w") as f:
            f.write(f"""\
ClusterName=megatronmoe
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
StateSaveLocation={self.path("state")}
SlurmdSpoolDir={self.path("spool")}/%n
SlurmctldLogFile={self.path("log", "slurmctld.log")}
SlurmdLogFile={self.path("log", "slurmd-%n.log")}
SlurmctldPidFile={self.path("run", "slurmctld.pid")}
SlurmdPidFile={self.path("run", "slurmd-%n.pid")}
SlurmctldDebug=info
SlurmdDebug=info
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _write_munge_key(self) -> None:
        munge = pwd.getpwnam("munge")
        os.makedirs(self.munge_dir)
        os.chmod(self.munge_dir, 0o755)  # munged: clients need execute permission on the socket dir
        key = os.path.join(self.munge_dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        for path in (self.munge_dir, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)

    def _spawn(self, name: str, cmd: list[str], **kwargs) -> None:
        log = open(self.path("log", f"{name}.out"), "w")
        self.daemons[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True, **kwargs
        )
        log.close()

    def start(self, timeout: float = 60) -> None:
        """munged, slurmctld -c, slurmd -N n1 and -N n2, then wait until both nodes are idle."""
        self.write_config()
        self._write_munge_key()
        m = self.munge_dir
        self._spawn(
            "munged",
            [
                "/usr/sbin/munged",
                "--foreground",
                f"--socket={self.socket}",
                f"--key-file={m}/munge.key",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
            user="munge",
            group="munge",
            extra_groups=[],
        )
        self._wait(lambda: os.path.exists(self.socket), timeout, "munged to create its socket")
        self._spawn("slurmctld", ["/usr/sbin/slurmctld", "-D", "-c", "-f", self.conf])
        for node in NODES:
            self._spawn(f"slurmd-{node}", ["/usr/sbin/slurmd", "-D", "-N", node, "-f", self.conf])
        self.wait_idle(timeout, f"nodes {', '.join(NODES)} to become idle")

    def wait_idle(self, timeout: float, what: str) -> None:
        """Until every node is idle (not allocated, not completing a job)."""
        self._wait(self.nodes_idle, timeout, what)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = {name: p.returncode for name, p in self.daemons.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"while waiting for {what}: daemons exited {dead}\n{self.diagnostics()}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout} s waiting for {what}\n{self.diagnostics()}")

    def nodes_idle(self) -> bool:
        result = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env(), timeout=30
        )
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in NODES)

    # ------------------------------------------------------------ jobs

    def submit(self, script: str, args: list[str], env: dict[str, str], cwd: str) -> str:
        """sbatch --parsable; returns the job id."""
        result = subprocess.run(
            ["sbatch", "--parsable", *args, script],
            capture_output=True,
            text=True,
            env={**self.env(), **env},
            cwd=cwd,
            timeout=60,
        )
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed ({result.returncode}): {result.stderr}\n{self.diagnostics()}")
        return result.stdout.strip().split(";")[0]

    def job_fields(self, job_id: str) -> dict[str, str]:
        result = subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True, env=self.env(), timeout=30
        )
        return dict(re.findall(r"(\w+)=(\S*)", result.stdout))

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """Poll `scontrol show job` every second until the job leaves PENDING/RUNNING/COMPLETING."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job_fields(job_id)
            if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return fields
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=self.env(), timeout=30)
                raise TimeoutError(f"job {job_id} still {fields.get('JobState')} after {timeout} s")
            time.sleep(1)

    # ------------------------------------------------------------ diagnostics and teardown

    def diagnostics(self, tail: int = 4000) -> str:
        """The daemons' logs (their ends), for failure messages."""
        parts = []
        for directory in (self.path("log"), self.munge_dir):
            if not os.path.isdir(directory):
                continue
            for name in sorted(os.listdir(directory)):
                if name.endswith((".log", ".out")):
                    with open(os.path.join(directory, name), errors="replace") as f:
                        parts.append(f"----- {name} -----\n{f.read()[-tail:]}")
        return "\n".join(parts)

    def _is_ours(self, proc: psutil.Process) -> bool:
        """Job processes carry our SLURM_CONF; slurmstepd (empty environment) holds a log file of ours open."""
        if proc.environ().get("SLURM_CONF") == self.conf:
            return True
        fd_dir = f"/proc/{proc.pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                if os.readlink(os.path.join(fd_dir, fd)).startswith(self.root + os.sep):
                    return True
            except OSError:
                continue
        return False

    def _tagged_processes(self) -> list[psutil.Process]:
        """Processes this cluster started, wherever they were reparented (slurmstepd double-forks)."""
        found = []
        for proc in psutil.process_iter(["pid", "create_time"]):
            if proc.pid == os.getpid() or proc.info["create_time"] < self.started - 1:
                continue
            try:
                if self._is_ours(proc):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, FileNotFoundError):
                continue
        return found

    def stop(self, timeout: float = 20) -> list[str]:
        """Stop the daemons by PID (SIGTERM, then SIGKILL), then anything they left; returns what had to be killed."""
        for proc in self.daemons.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.daemons.values():
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
        leftovers = self._tagged_processes()
        _, alive = psutil.wait_procs(leftovers, timeout=5)
        killed = []
        for proc in alive:
            try:
                killed.append(f"{proc.pid} {' '.join(proc.cmdline())}")
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.daemons.clear()
        return killed

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
