"""Launch backends and the launcher's command line: local device isolation, SSH through a stand-in `ssh` that
runs the remote line here (quoting, pid file, remote kill), SLURM command lines, config hints, group sizes."""

import inspect
import os
import stat
import subprocess
import sys
import time
import typing

import pytest

from reve_jax.elastic import backends
from reve_jax.elastic.launch import config_hints, group_sizes, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Drops ssh's options, the end of options and the host name, then runs the remote command line with bash, here.
FAKE_SSH = """#!/bin/bash
while [ "$1" = "-o" ]; do shift 2; done
[ "$1" = "--" ] && shift
shift
exec bash -c "$1"
"""


def wait_exit(proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            return code
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("process did not exit")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split(")")[-1].split()[0] != "Z"


def test_local_hosts_get_their_own_devices(monkeypatch, tmp_path):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_dump_to=/x")
    cpu = backends.LocalBackend(2, devices_per_host=3, marker_dir=str(tmp_path)).host_env("local1")
    assert cpu["JAX_PLATFORMS"] == "cpu"
    assert cpu["XLA_FLAGS"] == "--xla_dump_to=/x --xla_force_host_platform_device_count=3"
    assert cpu["REVE_PROBE_FAIL_MARKER"] == str(tmp_path / "local1")
    assert cpu["PYTHONPATH"].split(os.pathsep)[0] == ROOT
    gpu = backends.LocalBackend(4, gpus_per_host=2).host_env("local2")
    assert gpu["CUDA_VISIBLE_DEVICES"] == "4,5" and "JAX_PLATFORMS" not in gpu


def test_local_probe_passes_and_fails_on_marker(tmp_path):
    backend = backends.LocalBackend(1, devices_per_host=2, marker_dir=str(tmp_path))
    assert wait_exit(backend.probe("local0", {}, str(tmp_path / "p1.log"))) == 0
    (tmp_path / "local0").touch()
    assert wait_exit(backend.probe("local0", {}, str(tmp_path / "p2.log"))) == 1
    assert "marked broken" in (tmp_path / "p2.log").read_text()


@pytest.fixture
def fake_ssh(tmp_path):
    path = tmp_path / "ssh"
    path.write_text(FAKE_SSH)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_ssh_runs_remote_line_with_env_and_exit_code(fake_ssh, tmp_path):
    backend = backends.SSHBackend(["nodeA"], remote_dir=ROOT, python=sys.executable, ssh=(fake_ssh,))
    code = "import os, sys; print(os.getcwd(), os.environ['REVE_X']); sys.exit(7)"
    proc = backend.start("nodeA", ["python", "-c", code], {"REVE_X": "a b'c"}, str(tmp_path / "w.log"))
    assert wait_exit(proc) == 7
    assert (tmp_path / "w.log").read_text().strip() == f"{ROOT} a b'c"
    assert wait_exit(backend.probe("nodeA", {"JAX_PLATFORMS": "cpu"}, str(tmp_path / "p.log"))) == 0


def test_ssh_hands_the_secret_over_stdin_not_the_command_line(fake_ssh, tmp_path):
    backend = backends.SSHBackend(["nodeA"], remote_dir=ROOT, python=sys.executable, ssh=(fake_ssh,))
    secret = "5e" * 32
    code = "import os; print(os.environ['REVE_SECRET'] == '5e' * 32, os.environ['REVE_X'])"
    proc = backend.start("nodeA", ["python", "-c", code], {"REVE_X": "1", "REVE_SECRET": secret}, str(tmp_path / "l"))
    assert secret not in " ".join(proc.popen.args)
    assert wait_exit(proc) == 0
    assert (tmp_path / "l").read_text().split() == ["True", "1"]
    assert backends.facing_address(["127.0.0.1", "localhost"]) == "127.0.0.1"
    local = backends.SSHBackend(["127.0.0.1"], remote_dir=ROOT)
    assert local.heartbeat_bind() == local.heartbeat_host() == "127.0.0.1"  # never 0.0.0.0


def test_ssh_kill_reaches_the_remote_process_group(fake_ssh, tmp_path):
    backend = backends.SSHBackend(["nodeA"], remote_dir=ROOT, python=sys.executable, ssh=(fake_ssh,))
    pidfile = tmp_path / "child.pid"
    # The remote worker starts a child of its own: the kill must take both.
    code = (
        "import os, subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pidfile)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}'); time.sleep(120)"
    )
    proc = backend.start("nodeA", ["python", "-c", code], {}, str(tmp_path / "w.log"))
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text().count(" ") == 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p) for p in pidfile.read_text().split()]
    assert all(alive(p) for p in pids)
    proc.kill()
    assert wait_exit(proc, 10) != 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)


def test_ssh_pid_file_is_private_checked_before_a_kill_and_removed(fake_ssh, tmp_path, monkeypatch):
    """Finding 9: the pid file sat in the remote /tmp under a name `ps` shows before it was written, so another
    user could create it first and choose the process group the kill takes; it was never removed. Now it lives in
    the user's own 0700 directory, the kill takes only a plain pid above 1 from it, and it goes when the worker
    does."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # the stand-in ssh runs the remote line here, with this environment
    backend = backends.SSHBackend(["nodeA"], remote_dir=ROOT, python=sys.executable, ssh=(fake_ssh,))
    log = tmp_path / "w.log"
    proc = backend.start("nodeA", ["python", "-c", "import time; print('up', flush=True); time.sleep(60)"], {}, log)
    deadline = time.monotonic() + 30
    while "up" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    remote_line = proc.popen.args[-1]
    # The pid file's directory is the user's own, not /tmp (the checkout itself may be under /tmp: not checked).
    assert remote_line.startswith(backends._PRIVATE_PID_DIR) and '> "$d"/' in remote_line
    assert "/tmp" not in remote_line.replace(f"cd {ROOT}", "") and proc.popen.args[-3] == "--"  # no host as option
    (pidfile,) = home.rglob("*.pid")
    assert stat.S_IMODE(pidfile.parent.stat().st_mode) == 0o700 and stat.S_IMODE(pidfile.stat().st_mode) == 0o600
    pid = int(pidfile.read_text())
    assert alive(pid)
    # Whatever the file holds, the kill takes nothing but a plain pid above 1 from it.
    pidfile.write_text("12abc")
    refused = subprocess.run(proc._remote_kill, capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "holds no pid" in refused.stderr and alive(pid)
    pidfile.write_text(f"{pid}\n")
    proc.kill()
    assert wait_exit(proc, 20) != 0
    deadline = time.monotonic() + 10
    while (alive(pid) or pidfile.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid) and not pidfile.exists()
    # A worker that ends by itself removes its pid file too.
    done = backend.start("nodeA", ["python", "-c", "pass"], {}, tmp_path / "d.log")
    assert wait_exit(done) == 0 and not list(home.rglob("*.pid"))


def test_a_host_name_that_ssh_would_read_as_an_option_is_refused():
    for bad in ("-oProxyCommand=touch /tmp/x", "", "node 1"):
        with pytest.raises(ValueError, match="host name"):
            backends.SSHBackend(["n1", bad], remote_dir="/src")


def test_ssh_coordinator_port_changes_per_attempt():
    backend = backends.SSHBackend(["n1", "n2"], remote_dir="/src", advertise="sup.example")
    assert backend.coordinator("n1", 0) != backend.coordinator("n1", 1)
    assert backend.coordinator("n1", 3).startswith("n1:") and backend.heartbeat_host() == "sup.example"


def test_slurm_command_line(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    backend = backends.SlurmBackend(["gpu001", "gpu002"], srun_args=("--gpus-per-task=8",))
    argv = backend.srun_command("gpu002", ["python3", "scripts/train.py"], "reve-x")
    assert argv[:6] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=gpu002", "--job-name=reve-x", "--overlap"]
    assert argv[-3:] == ["--gpus-per-task=8", "python3", "scripts/train.py"]
    wrapped = backend.srun_command("gpu002", ["python3", "x.py"], "reve-x", read_secret=True)
    assert wrapped[-6:-2] == ["bash", "-c", 'IFS= read -r REVE_SECRET; export REVE_SECRET; exec "$@"', "reve-worker"]
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(RuntimeError, match="allocation"):
        backends.SlurmBackend(["gpu001"])


def protocol_problems(backend) -> list[str]:
    """Returns how `backend` (an instance) falls short of backends.Backend: a missing or mistyped data member,
    a missing method, or a method whose parameters (names, kinds, types, in order) or return type differ.
    Extra parameters are allowed when they have defaults."""
    problems = []
    for attr, kind in typing.get_type_hints(backends.Backend).items():
        if not isinstance(getattr(backend, attr, None), typing.get_origin(kind) or kind):
            problems.append(f"{attr}: not a {kind}")
    methods = [n for n, v in vars(backends.Backend).items() if inspect.isfunction(v) and not n.startswith("_")]
    for name in methods:
        impl = getattr(type(backend), name, None)
        if not inspect.isfunction(impl):
            problems.append(f"{name}: missing")
            continue
        want, got = inspect.signature(getattr(backends.Backend, name)), inspect.signature(impl)
        want_types = typing.get_type_hints(getattr(backends.Backend, name))
        got_types = typing.get_type_hints(impl)
        got_params = list(got.parameters.values())
        for i, p in enumerate(want.parameters.values()):
            q = got_params[i] if i < len(got_params) else None
            if q is None or (q.name, q.kind) != (p.name, p.kind) or got_types.get(q.name) != want_types.get(p.name):
                problems.append(f"{name}: parameter {p} is {q}")
        for q in got_params[len(want.parameters) :]:
            if q.default is inspect.Parameter.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
                problems.append(f"{name}: extra parameter {q} without a default")
        if got_types.get("return") != want_types.get("return"):
            problems.append(f"{name}: returns {got_types.get('return')}, not {want_types.get('return')}")
    return problems


def test_every_backend_follows_the_protocol(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    instances = {
        backends.LocalBackend: backends.LocalBackend(2),
        backends.SSHBackend: backends.SSHBackend(["n1"], remote_dir="/src"),
        backends.SlurmBackend: backends.SlurmBackend(["gpu001"]),
    }
    found = {c for n, c in vars(backends).items() if isinstance(c, type) and n.endswith("Backend") and n != "Backend"}
    assert found == set(instances), "a new backend: add an instance of it here"
    for cls, backend in instances.items():
        assert protocol_problems(backend) == [], cls.__name__


def test_protocol_check_catches_a_backend_that_falls_short():
    class Partial:
        name, hosts = "partial", ["h"]

        def coordinator(self, host: str, attempt: int) -> str: ...
        def heartbeat_host(self) -> str: ...
        def heartbeat_bind(self, port: int) -> str: ...
        def start(self, host: str, argv: list[str], env: dict) -> backends.Proc: ...

    problems = protocol_problems(Partial())
    assert [p.split(":")[0] for p in problems] == ["heartbeat_bind", "start", "probe"], problems


def test_launcher_arguments_and_hints():
    args, overrides = parse_args(
        ["--config", "configs/tiny.py", "--workdir", "w", "--hosts", "4", "--config.train.steps=7"]
    )
    assert args.hosts == "4" and overrides == ["--config.train.steps=7"]
    with pytest.raises(SystemExit):
        parse_args(["--config", "c", "--workdir", "w", "--hosts", "4", "--bogus"])
    hints = config_hints(os.path.join(ROOT, "configs", "tiny.py"), ["--config.train.steps=7"])
    assert hints["steps"] == 7 and hints["ckpt_every"] > 0 and hints["global_batch"] > 0
    assert group_sizes("auto", 4, 2, {"global_batch": 24}) == (1, 2, 3, 4)
    assert group_sizes("auto", 4, 2, {"global_batch": 32}) == (1, 2, 4)
    assert group_sizes("auto", 4, 2, {"global_batch": 32, "grad_accum": 2}) == (1, 2, 4)
    assert group_sizes("any", 4, 2, {"global_batch": 32}) == ()
    assert group_sizes("4,2", 4, 2, {}) == (2, 4)


def test_a_trainer_script_of_another_checkout_is_named_in_a_warning(tmp_path):
    """The launcher run with another checkout's scripts/train.py than the installed reve_jax's: a warning names
    both and the fix (its workers would run the installed code, with compile-ahead and snapshots off); this
    checkout's trainer and a non-trainer script give none."""
    from reve_jax.elastic.launch import other_checkout, precompile_argv, snapshot_override

    def args_for(script):
        return parse_args(["--config", "configs/tiny.py", "--workdir", "w", "--hosts", "2", "--script", script])[0]

    other = tmp_path / "checkout" / "scripts" / "train.py"
    mine = args_for(os.path.join(ROOT, "scripts", "train.py"))
    assert other_checkout(mine) is None and precompile_argv(mine, []) and snapshot_override(mine, [])
    theirs = args_for(str(other))
    warning = other_checkout(theirs)
    assert str(other) in warning and ROOT in warning and f"pip install -e {tmp_path / 'checkout'}" in warning
    assert precompile_argv(theirs, []) == [] and snapshot_override(theirs, []) == []
    assert other_checkout(args_for(str(tmp_path / "worker.py"))) is None
