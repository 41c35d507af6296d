"""A SLURM cluster on the namespace test bed: one slurmctld on this machine (the bridge address), one slurmd per
namespace host (node name = the namespace's name), one munged for all of them (munge authenticates through a
local socket, which the namespaces share), all with files under `root` and ports of their own, so nothing
touches a system SLURM or munge. The sockets (munge's, and those slurmstepd makes in each node's spool directory)
live in a short private directory under /tmp instead: a Unix socket's path has at most 107 bytes, which a deep
`root` (pytest's per-worker temporary directories) exceeds.

    with NetnsBed(3, d) as bed, SlurmCluster(bed, d + "/slurm") as cluster:
        cluster.env                               # SLURM_CONF=...: for sbatch, srun, squeue, scontrol
        job = cluster.sbatch(script_path, nodes=3, output=path)

Needs slurm-wlm and munge (Debian); SlurmCluster.unavailable() says what is missing.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from reve_jax.elastic.testbed import NetnsBed


class SlurmCluster:
    def __init__(self, bed: NetnsBed, root: str):
        self.bed, self.root = bed, os.path.abspath(root)
        self.nodes = list(bed.namespaces)
        self.conf = os.path.join(self.root, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self._procs: list[subprocess.Popen] = []
        self._sockets = ""  # the short directory for sockets and spools, made by start()

    @staticmethod
    def unavailable() -> str:
        missing = [b for b in ("slurmctld", "slurmd", "sbatch", "munged", "nsenter", "unshare") if not shutil.which(b)]
        return f"missing {', '.join(missing)} (slurm-wlm, munge, util-linux)" if missing else ""

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def _munge_socket(self) -> str:
        return os.path.join(self._sockets, "munge.sock")

    def start(self, timeout: float = 60.0) -> None:
        os.makedirs(os.path.join(self.root, "state"), exist_ok=True)
        self._sockets = tempfile.mkdtemp(prefix="rvslurm", dir="/tmp")  # mode 0700
        os.chmod(self.root, 0o700)  # munged refuses a key in a directory others can write
        key = os.path.join(self.root, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        subprocess.run(
            ["munged", "--force", f"--socket={self._munge_socket}", f"--key-file={key}",
             f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log",
             f"--seed-file={self.root}/munged.seed"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        self._write_conf()
        self._daemon(["slurmctld", "-D", "-i", "-f", self.conf], "slurmctld.out")
        for i, node in enumerate(self.nodes):
            os.makedirs(os.path.join(self._sockets, f"spool_{node}"), exist_ok=True)
            self._daemon(self.bed.in_host(i, ["slurmd", "-D", "-N", node, "-f", self.conf]), f"slurmd_{node}.out")
        deadline = time.monotonic() + timeout
        while True:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
            states = dict(zip(out[::2], out[1::2], strict=False))
            if len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM nodes not idle after {timeout} s: {states}; see {self.root}")
            time.sleep(0.3)

    def _write_conf(self) -> None:
        port = random.randrange(20000, 40000)
        nodes = "".join(
            f"NodeName={n} NodeAddr={a} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN\n"
            for n, a in zip(self.nodes, self.bed.hosts, strict=True)
        )
        with open(self.conf, "w") as f:
            f.write(
                f"ClusterName=rv{self.bed.tag}\n"
                f"SlurmctldHost={socket.gethostname()}({self.bed.gateway})\n"
                f"SlurmctldPort={port}\nSlurmdPort={port + 1}\n"
                f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={self._munge_socket}\n"
                "SlurmUser=root\nSlurmdUser=root\nMailProg=/bin/true\n"
                f"StateSaveLocation={self.root}/state\nSlurmdSpoolDir={self._sockets}/spool_%n\n"
                f"SlurmctldPidFile={self.root}/slurmctld.pid\nSlurmdPidFile={self.root}/slurmd_%n.pid\n"
                f"SlurmctldLogFile={self.root}/slurmctld.log\nSlurmdLogFile={self.root}/slurmd_%n.log\n"
                # No cgroups, accounting or MPI: processes are tracked by their parent, steps share CPUs.
                "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
                "AccountingStorageType=accounting_storage/none\nMpiDefault=none\nSwitchType=switch/none\n"
                "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nSchedulerType=sched/builtin\n"
                "ReturnToService=2\nSlurmctldTimeout=30\nSlurmdTimeout=30\nInactiveLimit=0\nKillWait=2\n"
                "MinJobAge=30\n"
                f"{nodes}PartitionName=bed Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
            )

    def _daemon(self, argv: list[str], log_name: str) -> None:
        with open(os.path.join(self.root, log_name), "ab") as log:
            self._procs.append(
                subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )

    def run(
        self,
        argv: list[str],
        check: bool = True,
        timeout: float = 30.0,
        cwd: str | None = None,
        env: dict | None = None,
    ) -> subprocess.CompletedProcess:
        """Runs a SLURM client command (sbatch, squeue, scancel...) against this cluster, from `cwd`, with `env`
        added to the environment."""
        return subprocess.run(
            argv, env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=check
        )

    def sbatch(
        self, script: str, nodes: int, output: str, args=(), cwd: str | None = None, env: dict | None = None
    ) -> str:
        """Submits `script` with `args` on `nodes` nodes, from `cwd` (the job's submit directory), with `env`
        added to the environment sbatch exports to the job; returns the job id."""
        argv = ["sbatch", "--parsable", f"--nodes={nodes}", f"--output={output}", script, *args]
        return self.run(argv, cwd=cwd, env=env).stdout.strip().split(";")[0]

    def job_state(self, job: str) -> str:
        """PENDING, RUNNING, COMPLETED, ... ("" once the controller has forgotten the job)."""
        out = self.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip()
        return out or self.run(["scontrol", "show", "job", job], check=False).stdout.partition("JobState=")[2][:9]

    def close(self) -> None:
        """Stops every daemon started here (their process groups) and munged, and removes the socket directory."""
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._procs = []
        with contextlib.suppress(OSError, ValueError), open(os.path.join(self.root, "munged.pid")) as f:
            os.kill(int(f.read().strip()), signal.SIGTERM)
        if self._sockets:
            shutil.rmtree(self._sockets, ignore_errors=True)
            self._sockets = ""
