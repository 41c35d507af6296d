"""Where worker processes run: local processes (the test bed and one node), SSH to a list of hosts, SLURM
(srun inside an allocation). A backend starts one process on a host, kills it with everything it started,
and runs the health probe there; the supervisor does the rest.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import uuid
from typing import Protocol

from reve_jax.elastic import auth

PROBE_MODULE = "reve_jax.elastic.probe"
# The checkout this package runs from: local workers import reve_jax from here whatever their cwd.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    """Returns a TCP port that was free on this machine a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_quietly(argv: list[str], timeout: float = 15.0) -> threading.Thread:
    """Runs a best-effort helper command (remote kill) in a thread so the supervisor's loop never waits on it;
    returns the thread (joined on the way out, so that the remote side is cleaned up before the launcher exits)."""

    def go():
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


class Proc:
    """A started process: `poll()` gives its exit code or None; `kill()` SIGKILLs its process group (and, for
    remote backends, the remote processes through `remote_kill`)."""

    def __init__(self, popen: subprocess.Popen, log, remote_kill: list[str] | None = None):
        self.popen, self._log, self._remote_kill = popen, log, remote_kill
        self.pid = popen.pid
        self.killing: threading.Thread | None = None  # the remote kill, while it runs

    def poll(self) -> int | None:
        code = self.popen.poll()
        if code is not None and self._log is not None:
            self._log.close()
            self._log = None
        return code

    def kill(self) -> None:
        if self._remote_kill:
            self.killing = _run_quietly(self._remote_kill)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)


def spawn(
    argv: list[str], env: dict, log_path: str, cwd: str | None, remote_kill=None, stdin_line: str | None = None
) -> Proc:
    """Starts `argv`; `stdin_line` (the run's secret for a remote worker) is written to its standard input,
    which is then closed."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    log = open(log_path, "ab")  # noqa: SIM115 (closed by Proc.poll once the process is gone)
    popen = subprocess.Popen(
        argv,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL if stdin_line is None else subprocess.PIPE,
        cwd=cwd,
        start_new_session=True,  # its own process group: kill() takes its children too, ^C does not reach it
    )
    if stdin_line is not None:
        with contextlib.suppress(OSError):  # a command that died at once: its exit code tells
            popen.stdin.write(stdin_line.encode() + b"\n")
        with contextlib.suppress(OSError):
            popen.stdin.close()
    return Proc(popen, log, remote_kill)


# The remote side of the secret's hand-off: the first line of stdin becomes REVE_SECRET, exported to the worker.
_READ_SECRET = f"IFS= read -r {auth.SECRET_ENV}; export {auth.SECRET_ENV}"


def facing_address(hosts: list[str]) -> str:
    """Returns this machine's address on the route to `hosts` (the one they reach it at): the supervisor's
    channel listens there only. Raises ValueError if the hosts are reached through different addresses."""
    seen = set()
    for host in hosts:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))  # UDP connect sends nothing; it only picks the route
            seen.add(s.getsockname()[0])
    if len(seen) != 1:
        raise ValueError(f"the hosts are reached through different local addresses {sorted(seen)}: pass --advertise")
    return seen.pop()


class Backend(Protocol):
    """What the supervisor and the launcher ask of a place to run workers. LocalBackend, SSHBackend and
    SlurmBackend follow it; tests/test_elastic_backends.py checks that every class here named *Backend
    provides each member with a compatible signature.

    A host is a name from `hosts`. The supervisor's loop calls these methods: none waits for the remote
    process (`start` and `probe` return once the local process is started; `Proc.kill` leaves the remote kill
    to a thread)."""

    name: str  # how events.jsonl and the console name the backend: "local", "ssh", "slurm"
    hosts: list[str]  # every host this backend can run on, in order; the launcher sizes groups from it

    def coordinator(self, host: str, attempt: int) -> str:
        """Returns "address:port" for jax.distributed's coordinator of group `attempt`, whose process 0 runs
        on `host`. Every process of the group must reach it; successive attempts get different ports, since
        the previous coordinator's port may still be held."""
        ...

    def heartbeat_host(self) -> str:
        """Returns the address at which workers on every host reach this machine (the supervisor's heartbeat
        channel); it goes into each worker's REVE_HEARTBEAT."""
        ...

    def heartbeat_bind(self) -> str:
        """Returns the local IP address the heartbeat channel listens on: the interface the hosts reach, never
        0.0.0.0."""
        ...

    def start(self, host: str, argv: list[str], env: dict, log_path: str) -> Proc:
        """Starts `argv` on `host` and returns at once; an argument "python" stands for the backend's
        interpreter there. `env` is added to the worker's environment; its REVE_SECRET (auth.SECRET_ENV) must never
        appear on a command line (pass it through the environment or standard input). Its stdout and stderr
        are appended to `log_path` on this machine. The returned Proc's `poll()` gives the worker's exit code
        once it is gone (None while it runs), `pid` is the local process's id (recorded in events.jsonl), and
        `kill()` stops the remote process with everything it started, not only the local ssh or srun."""
        ...

    def probe(self, host: str, env: dict, log_path: str) -> Proc:
        """Starts the health probe (PROBE_MODULE) on `host` like `start`, with `env`; the Proc exits 0 when
        the host can run a worker, non-zero otherwise."""
        ...


class LocalBackend:
    """`num_hosts` processes on this machine, each its own "host" (local0, local1, ...) with
    `devices_per_host` emulated CPU devices, or `gpus_per_host` GPUs of its own through CUDA_VISIBLE_DEVICES.

    `marker_dir`: the probe of host h fails while `<marker_dir>/<h>` exists (a host that stays broken until
    someone removes the file)."""

    name = "local"

    def __init__(
        self,
        num_hosts: int,
        devices_per_host: int = 2,
        gpus_per_host: int = 0,
        python: str = "",
        cwd: str | None = None,
        marker_dir: str = "",
    ):
        self.hosts = [f"local{i}" for i in range(num_hosts)]
        self.devices_per_host, self.gpus_per_host = devices_per_host, gpus_per_host
        self.python = python or sys.executable
        self.cwd, self.marker_dir = cwd, marker_dir

    def host_env(self, host: str) -> dict:
        """Returns the variables that give `host` its own devices."""
        i = self.hosts.index(host)
        env = {"PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)}
        if self.marker_dir:
            env["REVE_PROBE_FAIL_MARKER"] = os.path.join(self.marker_dir, host)
        if self.gpus_per_host:
            gpus = range(i * self.gpus_per_host, (i + 1) * self.gpus_per_host)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        else:
            flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={self.devices_per_host}".strip()
            env["JAX_PLATFORMS"] = "cpu"
        return env

    def coordinator(self, host: str, attempt: int) -> str:
        return f"127.0.0.1:{free_port()}"

    def heartbeat_host(self) -> str:
        return "127.0.0.1"

    def heartbeat_bind(self) -> str:
        return "127.0.0.1"  # every worker is on this machine

    def start(self, host: str, argv: list[str], env: dict, log_path: str) -> Proc:
        argv = [self.python if a == "python" else a for a in argv]
        return spawn(argv, {**os.environ, **env, **self.host_env(host)}, log_path, self.cwd)

    def probe(self, host: str, env: dict, log_path: str) -> Proc:
        return self.start(host, ["python", "-m", PROBE_MODULE], env, log_path)


# The remote pid files live in a directory of the remote user's own, never in the shared /tmp: a name there is
# visible in `ps` before the file is written, and another user who creates it first would choose the process group
# the kill takes. The shell checks the directory is a real directory of this user (mode 0700 by the umask).
_PID_DIR = '"$HOME/.cache/reve_jax/pids"'
_PRIVATE_PID_DIR = (
    f'umask 077; d={_PID_DIR}; mkdir -p "$d" && [ -d "$d" ] && [ ! -L "$d" ] && [ -O "$d" ] && chmod 700 "$d" '
    '|| { echo "reve_jax: $d is not a private directory of this user" >&2; exit 97; }'
)


def check_host_name(host: str) -> str:
    """Returns `host` if ssh can only read it as a host name: not empty, not starting with "-" (an option, e.g.
    -oProxyCommand=...), no whitespace or control characters; raises ValueError saying which name is wrong."""
    if not host or host.startswith("-") or any(c.isspace() or not c.isprintable() for c in host):
        raise ValueError(
            f"host name {host!r} is not usable: names must not be empty, start with '-' (ssh would read an "
            "option) or contain spaces; give hosts as they resolve (node1, 10.0.0.5)"
        )
    return host


class _RemoteHosts:
    """Addressing shared by the backends that start processes on other machines: the coordinator on the host it is
    given, at a fresh port per attempt (the previous coordinator's port may still be held there), and the heartbeat
    channel on `advertise` if given, else on this machine's address facing the hosts."""

    hosts: list[str]
    base_port: int
    advertise: str

    def coordinator(self, host: str, attempt: int) -> str:
        return f"{host}:{self.base_port + attempt % 500}"

    def heartbeat_host(self) -> str:
        return self.advertise or facing_address(self.hosts)

    def heartbeat_bind(self) -> str:
        return socket.gethostbyname(self.advertise) if self.advertise else facing_address(self.hosts)


class SSHBackend(_RemoteHosts):
    """One process per host through `ssh host`, run from `remote_dir` there (the same checkout on every host).

    The remote process runs in its own session and writes its id to a pid file in a directory of the remote
    user's own (`~/.cache/reve_jax/pids`, 0700), so `kill()` can SIGKILL its whole process group over a second
    ssh connection; the file goes when the process ends or is killed. ServerAlive options make the local ssh exit
    (code 255) when a host stops answering. Host names go to ssh after `--` and are checked (`check_host_name`)."""

    name = "ssh"

    def __init__(
        self,
        hosts: list[str],
        remote_dir: str,
        python: str = "python3",
        base_port: int = 29500,
        advertise: str = "",
        ssh: tuple[str, ...] = ("ssh",),
    ):
        self.hosts = [check_host_name(h) for h in hosts]
        self.remote_dir, self.python, self.base_port = remote_dir, python, base_port
        self.advertise = advertise
        self.ssh = list(ssh) + [
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
            "-o",
            "ServerAliveInterval=5",
            "-o",
            "ServerAliveCountMax=2",
        ]

    def remote_command(self, argv: list[str], env: dict, pid_name: str, read_secret: bool = False) -> str:
        """Returns the shell line run on the remote host: start `argv` with `env` in its own session, record its
        pid in the private pid file `pid_name`, and exit with its exit code once it is gone (removing the file).
        With `read_secret`, the first line of stdin becomes the worker's REVE_SECRET."""
        argv = [self.python if a == "python" else a for a in argv]
        assigns = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items())
        cmd = " ".join(shlex.quote(a) for a in argv)
        secret = f"{_READ_SECRET}; " if read_secret else ""
        pf = f'"$d"/{shlex.quote(pid_name)}'
        # The file goes however the shell ends: the worker's exit, or the session cut (SIGHUP when ssh is killed).
        return (
            f"{_PRIVATE_PID_DIR}; trap 'rm -f -- {pf}' EXIT; trap 'exit 129' HUP TERM; "
            f"cd {shlex.quote(self.remote_dir)} && {{ {secret}env {assigns} setsid {cmd} & "
            f"echo $! > {pf}; wait $!; }}"
        )

    @staticmethod
    def kill_command(pid_name: str) -> str:
        """The remote line that SIGKILLs the process group named in pid file `pid_name`: only a plain number
        above 1 is taken from it (-1 would be every process of the user, 0 the shell's own group)."""
        pf = f'"$d"/{shlex.quote(pid_name)}'
        return (
            f"d={_PID_DIR}; p=$(cat -- {pf} 2>/dev/null); "
            f'case "$p" in ""|*[!0-9]*) echo "reve_jax: pid file {pid_name} holds no pid" >&2; exit 1;; esac; '
            f'[ "$p" -gt 1 ] || {{ echo "reve_jax: pid file {pid_name} holds pid $p" >&2; exit 1; }}; '
            f'kill -9 -- "-$p"; rm -f -- {pf}'
        )

    def start(self, host: str, argv: list[str], env: dict, log_path: str) -> Proc:
        env = dict(env)
        secret = env.pop(auth.SECRET_ENV, None)  # through ssh's stdin, never on the command line
        pid_name = f"{uuid.uuid4().hex}.pid"
        line = self.remote_command(argv, env, pid_name, read_secret=secret is not None)
        kill = self.ssh + ["--", host, self.kill_command(pid_name)]
        return spawn(self.ssh + ["--", host, line], dict(os.environ), log_path, None, kill, stdin_line=secret)

    def probe(self, host: str, env: dict, log_path: str) -> Proc:
        return self.start(host, ["python", "-m", PROBE_MODULE], env, log_path)


class SlurmBackend(_RemoteHosts):
    """One `srun` step per host inside the current allocation (SLURM_JOB_ID set); hosts default to the
    allocation's nodes. `srun_args` are added to every step (e.g. --gpus-per-task=8). `kill()` cancels the
    step with SIGKILL through scancel (killing srun alone can leave its tasks running) and then kills
    srun."""

    name = "slurm"

    def __init__(
        self,
        hosts: list[str] | None = None,
        srun_args: tuple[str, ...] = (),
        base_port: int = 29500,
        advertise: str = "",
        python: str = "python3",
    ):
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        if not self.job_id:
            raise RuntimeError("the slurm backend runs inside an allocation (salloc/sbatch): SLURM_JOB_ID unset")
        self.hosts = list(hosts) if hosts else allocation_hosts()
        self.srun_args, self.base_port, self.advertise = list(srun_args), base_port, advertise
        self.python = python

    def srun_command(self, host: str, argv: list[str], step_name: str, read_secret: bool = False) -> list[str]:
        """Returns the srun line that runs `argv` as one task on `host`; with `read_secret`, through a shell
        that makes the first line of stdin (srun forwards it to the task) the worker's REVE_SECRET."""
        if read_secret:
            argv = ["bash", "-c", f'{_READ_SECRET}; exec "$@"', "reve-worker", *argv]
        return [
            "srun",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={host}",
            f"--job-name={step_name}",
            "--overlap",
            "--kill-on-bad-exit=1",
            "--export=ALL",
            *self.srun_args,
            *argv,
        ]

    def start(self, host: str, argv: list[str], env: dict, log_path: str) -> Proc:
        env = dict(env)
        secret = env.pop(auth.SECRET_ENV, None)  # through srun's stdin: not in srun's environment or argv
        name = f"reve-{uuid.uuid4().hex[:12]}"
        argv = [self.python if a == "python" else a for a in argv]
        # scancel by step name: the step id is known only to srun.
        kill = [
            "bash",
            "-c",
            f"squeue --steps --noheader --format='%i %j' --jobs {self.job_id} | "
            f"awk '$2==\"{name}\" {{print $1}}' | xargs -r scancel --signal=KILL",
        ]
        srun = self.srun_command(host, argv, name, read_secret=secret is not None)
        return spawn(srun, {**os.environ, **env}, log_path, None, kill, stdin_line=secret)

    def probe(self, host: str, env: dict, log_path: str) -> Proc:
        return self.start(host, ["python", "-m", PROBE_MODULE], env, log_path)


def allocation_hosts() -> list[str]:
    """Returns the node names of the current SLURM allocation."""
    nodelist = os.environ["SLURM_JOB_NODELIST"]
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
    )
    return out.stdout.split()
