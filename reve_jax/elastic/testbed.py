"""A multi-host test bed on one Linux machine: N hosts as network namespaces on a private bridge, each with
its own address and a real sshd, for the elastic supervisor's SSH (and SLURM) backends and for the faults a
cluster has: a killed or frozen worker, a host cut off the network, a host whose sshd is down.

    with NetnsBed(4, "/tmp/bed") as bed:          # needs root and `ip`; NetnsBed.unavailable() says why not
        bed.hosts                                 # ["10.213.7.10", ...]; the supervisor is 10.213.7.1
        bed.ssh                                   # ("ssh", "-F", ...): pass to SSHBackend(ssh=...)
        bed.partition(2); bed.heal(2); bed.stop_sshd(1); bed.start_sshd(1)

Namespaces isolate the network only: every host shares this machine's filesystem (the run directory is
"shared storage") and process table. Traffic stays on the bridge, on addresses of a /24 in 10.213.0.0/16 that
no interface here uses. Everything made is removed by close() (also after a failure; the context manager
calls it); close() never raises.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time

_IP = shutil.which("ip") or "/usr/sbin/ip"
_SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def _run(*argv: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=check)


def _used_subnets() -> set[int]:
    out = _run(_IP, "-4", "-o", "addr", check=False).stdout
    return {int(w.split(".")[2]) for w in out.split() if w.startswith("10.213.")}


class NetnsBed:
    """`n` hosts, namespaces named rv<tag>h<i>, addresses 10.213.<net>.(10 + i)/24 on bridge rv<tag>br whose
    address (10.213.<net>.1) is this machine's, where the supervisor listens. `root` holds keys, configs and
    sshd logs."""

    def __init__(self, n: int, root: str):
        self.n, self.root = n, os.path.abspath(root)
        self.tag = f"{random.randrange(16**4):04x}"
        free = [s for s in range(16, 250) if s not in _used_subnets()]
        self.net = random.choice(free)
        self.gateway = f"10.213.{self.net}.1"
        self.hosts = [f"10.213.{self.net}.{10 + i}" for i in range(n)]
        self.namespaces = [f"rv{self.tag}h{i}" for i in range(n)]
        self.bridge = f"rv{self.tag}br"
        self._veths = [f"rv{self.tag}v{i}" for i in range(n)]  # this machine's end of host i's link
        self._sshd: dict[int, subprocess.Popen] = {}
        self._made_ns: list[str] = []
        self.ssh_config = os.path.join(self.root, "ssh_config")
        self.ssh = ("ssh", "-F", self.ssh_config)

    # ------------------------------------------------------------------------------------------- set-up
    @staticmethod
    def unavailable() -> str:
        """Why no bed can be made here ("" if it can): not root, no `ip`, no sshd, namespaces refused."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if not os.path.exists(_IP):
            return "no `ip` command (iproute2)"
        if not os.path.exists(_SSHD):
            return "no sshd (openssh-server)"
        name = f"rvprobe{os.getpid()}"
        made = _run(_IP, "netns", "add", name, check=False)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
        _run(_IP, "netns", "del", name, check=False)
        return ""

    def __enter__(self) -> NetnsBed:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        self._keys()
        _run(_IP, "link", "add", self.bridge, "type", "bridge")
        _run(_IP, "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run(_IP, "link", "set", self.bridge, "up")
        hostname = socket.gethostname()
        for i, (ns, veth, addr) in enumerate(zip(self.namespaces, self._veths, self.hosts, strict=True)):
            _run(_IP, "netns", "add", ns)
            self._made_ns.append(ns)
            inner = f"rv{self.tag}n{i}"
            _run(_IP, "link", "add", veth, "type", "veth", "peer", "name", inner)
            _run(_IP, "link", "set", inner, "netns", ns)
            _run(_IP, "link", "set", veth, "master", self.bridge, "up")
            for cmd in (
                ("addr", "add", f"{addr}/24", "dev", inner),
                ("link", "set", inner, "up"),
                ("link", "set", "lo", "up"),
            ):
                _run(_IP, "netns", "exec", ns, _IP, *cmd)
            # `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts: there this machine's name means the
            # host's own address, which is what JAX's gloo collectives bind to and announce to their peers, and
            # every host's namespace name is its address (node names for SLURM).
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            names = "".join(f"{a} {n}\n" for a, n in zip(self.hosts, self.namespaces, strict=True))
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{addr} {hostname}\n{names}")
            self._write_sshd_config(i)
            self.start_sshd(i)
        for i in range(self.n):
            self._wait_port(self.hosts[i], 22, 20.0)

    def _keys(self) -> None:
        open(os.path.join(self.root, "empty"), "w").close()
        for name in ("client_key", "host_key"):
            path = os.path.join(self.root, name)
            if not os.path.exists(path):
                _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path)
        shutil.copy(os.path.join(self.root, "client_key.pub"), os.path.join(self.root, "authorized_keys"))
        with open(self.ssh_config, "w") as f:
            f.write(
                "Host *\n"
                f"  IdentityFile {self.root}/client_key\n"
                "  User root\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
                "  BatchMode yes\n  ConnectTimeout 5\n"
            )

    def _write_sshd_config(self, i: int) -> None:
        with open(os.path.join(self.root, f"sshd_{i}.conf"), "w") as f:
            f.write(
                f"ListenAddress {self.hosts[i]}:22\n"
                f"HostKey {self.root}/host_key\n"
                f"AuthorizedKeysFile {self.root}/authorized_keys\n"
                f"PidFile {self.root}/sshd_{i}.pid\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "UsePAM no\nStrictModes no\nPrintMotd no\nMaxStartups 200\nMaxSessions 100\nLogLevel ERROR\n"
            )

    def _wait_closed(self, addr: str, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection((addr, port), timeout=1.0).close()
            except OSError:
                return
            time.sleep(0.05)

    def _wait_port(self, addr: str, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((addr, port), timeout=1.0).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nothing listens on {addr}:{port} after {timeout} s") from None
                time.sleep(0.05)

    # ------------------------------------------------------------------------------------------- faults
    def start_sshd(self, i: int) -> None:
        """Starts host i's sshd (in the foreground under our control, logging to sshd_<i>.log)."""
        log = open(os.path.join(self.root, f"sshd_{i}.log"), "ab")  # noqa: SIM115 (inherited by sshd, closed here)
        conf = os.path.join(self.root, f"sshd_{i}.conf")
        self._sshd[i] = subprocess.Popen(
            self.in_host(i, [_SSHD, "-D", "-e", "-f", conf]),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        if len(self._sshd) == self.n:  # after start(): wait for it to answer
            self._wait_port(self.hosts[i], 22, 20.0)

    def stop_sshd(self, i: int) -> None:
        """Stops host i's sshd listener; sessions already open (running workers) go on."""
        proc = self._sshd.pop(i, None)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)  # the listener only: sessions are its children in their own right
            proc.wait(timeout=10)
            self._wait_closed(self.hosts[i], 22, 10.0)

    def partition(self, i: int) -> None:
        """Cuts host i off the network (its link down): its processes run on, unreachable."""
        _run(_IP, "link", "set", self._veths[i], "down")

    def heal(self, i: int) -> None:
        _run(_IP, "link", "set", self._veths[i], "up")

    def in_host(self, i: int, argv: list[str]) -> list[str]:
        """`argv` run in host i's network namespace, in a mount namespace of its own where /etc/hosts is the
        host's and root's ~/.bashrc is empty: bash run by sshd reads it, and a shell set-up that waits (a pyenv
        rehash lock left by a killed session waits 60 s) must not decide a test. This machine's /sys stays
        (`ip netns exec` would replace it, hiding the cgroup mounts slurmd needs)."""
        ns = self.namespaces[i]
        bashrc = os.path.expanduser("~/.bashrc")
        quiet = f"mount --bind {self.root}/empty {bashrc} && " if os.path.exists(bashrc) else ""
        script = f'mount --bind /etc/netns/{ns}/hosts /etc/hosts && {quiet}exec "$0" "$@"'
        return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--propagation", "private",
                "sh", "-c", script, *argv]  # fmt: skip

    def pids(self, i: int, needle: str = "") -> list[int]:
        """Processes running in host i's namespace whose command line contains `needle`."""
        out = _run(_IP, "netns", "pids", self.namespaces[i], check=False).stdout.split()
        found = []
        for pid in map(int, out):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmdline:
                found.append(pid)
        return found

    # ------------------------------------------------------------------------------------------ tear-down
    def close(self) -> None:
        """Kills every process in the namespaces, removes them, the links, the bridge and /etc/netns entries."""
        for i in list(self._sshd):
            with contextlib.suppress(Exception):
                self.stop_sshd(i)
        for ns in self._made_ns:
            # A namespace is only gone once nothing runs in it (or holds it in a mount namespace of its own).
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    pids = _run(_IP, "netns", "pids", ns, check=False).stdout.split()
                    for pid in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                    if not pids and _run(_IP, "netns", "del", ns, check=False).returncode == 0:
                        break
                time.sleep(0.1)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self._made_ns = []
        for veth in self._veths:  # normally gone with its peer's namespace
            with contextlib.suppress(Exception):
                _run(_IP, "link", "del", veth, check=False)
        with contextlib.suppress(Exception):
            _run(_IP, "link", "del", self.bridge, check=False)
