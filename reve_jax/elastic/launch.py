"""Command line of the elastic launcher (`scripts/launch.py`): one training process per host, kept alive.

    python scripts/launch.py --config configs/x.py --workdir runs/x --hosts 4 [--config.train.steps=100 ...]
    python scripts/launch.py --config configs/x.py --workdir runs/x --hosts node1,node2 --remote-dir /src/reve
    python scripts/launch.py --config configs/x.py --workdir runs/x --slurm      # inside salloc/sbatch

`--hosts N` runs N local processes (each its own emulated CPU devices, or --gpus-per-host GPUs); a comma list
of names uses SSH; --slurm runs one srun step per node of the allocation. Arguments `--config.a.b=v` go to
every worker unchanged.

By default it runs the best policy measured (docs/elastic.md, docs/planning.md): the fast restart (warm
standbys, compile-ahead, one executable per group), in-memory snapshots with a copy on the ring successor every
`--snapshot-every` steps (the trainer), and re-admission by cost with a host MTBF guess that the run corrects
from its own failures. `scripts/simulate_cluster.py` with no flags simulates exactly these defaults (DEFAULTS).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from reve_jax import cli
from reve_jax.elastic import backends, inprocess
from reve_jax.elastic.policy import PolicyConfig
from reve_jax.elastic.supervisor import Supervisor, WorkerSettings

# The launcher's defaults, in one place: its options' and the cluster simulator's (scripts/simulate_cluster.py
# with no flags simulates the launcher as it runs by default), with the recovery mechanisms, in the simulator's
# names (reve_jax.tools.plan.cluster.RECOVERY_MECHANISMS), that it turns on unless told otherwise.
DEFAULTS = {
    "heartbeat_timeout": 5.0,
    "progress_timeout": 120.0,
    "startup_timeout": 300.0,
    "stop_timeout": 120.0,
    "probe_interval": 10.0,
    "max_strikes": 3,
    # One 8-GPU host at Llama 3's failure rate (419 interruptions in 54 days on 16,384 GPUs): 264 days. A starting
    # guess: the policy corrects it from the run's own failures (Policy.host_mtbf_estimate).
    "host_mtbf_h": 6336.0,
    "snapshot_every": 10,  # steps; with the trainer (elastic.snapshot_every), unless the config sets it
}
DEFAULT_MECHANISMS = ("fast_restart", "snapshots")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Returns the launcher's options and the `--config.*` overrides passed through to the workers."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="experiment config file, passed to every worker")
    p.add_argument("--workdir", required=True, help="run directory: checkpoints, events.jsonl, logs/")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--hosts", help="N local processes, or a comma list of host names for SSH")
    where.add_argument("--slurm", action="store_true", help="one srun step per node of this allocation")
    p.add_argument("--script", default="scripts/train.py", help="worker entry point")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker argument (repeatable)")
    p.add_argument("--python", default="", help="python on the hosts (default: this one locally, python3)")
    p.add_argument(
        "--devices-per-host",
        type=int,
        default=None,
        help="emulated CPU devices per host: local processes (default 2); with SSH/SLURM, hosts run JAX on CPU "
        "with this many devices (the namespace test bed)",
    )
    p.add_argument("--gpus-per-host", type=int, default=0, help="local: GPUs per process (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--marker-dir", default="", help="local: probe of host h fails while <dir>/h exists")
    p.add_argument("--remote-dir", default=os.getcwd(), help="ssh: checkout directory on the hosts")
    p.add_argument("--ssh-arg", action="append", default=[], help="ssh: extra ssh argument (repeatable), e.g. -F")
    p.add_argument("--advertise", default="", help="address workers use to reach this supervisor")
    p.add_argument("--srun-arg", action="append", default=[], help="slurm: extra srun argument (repeatable)")
    p.add_argument("--compile-cache", default="", help="persistent XLA cache (default <workdir>/../jax_cache)")
    p.add_argument("--min-hosts", type=int, default=1)
    p.add_argument(
        "--max-strikes", type=int, default=DEFAULTS["max_strikes"], help="failures after which a host is excluded"
    )
    p.add_argument(
        "--group-sizes",
        default="auto",
        help="allowed hosts per group: comma list, 'any', or 'auto' (the global batch divides)",
    )
    p.add_argument("--heartbeat-timeout", type=float, default=DEFAULTS["heartbeat_timeout"])
    p.add_argument(
        "--progress-timeout", type=float, default=DEFAULTS["progress_timeout"], help="s at one training step: hung"
    )
    p.add_argument(
        "--startup-timeout", type=float, default=DEFAULTS["startup_timeout"], help="grace while starting/compiling"
    )
    p.add_argument(
        "--stop-timeout", type=float, default=DEFAULTS["stop_timeout"], help="grace for a clean stop before a kill"
    )
    p.add_argument("--probe-interval", type=float, default=DEFAULTS["probe_interval"])
    p.add_argument("--no-readmit", action="store_true", help="never re-admit a failed host")
    p.add_argument(
        "--host-mtbf-h",
        type=float,
        default=DEFAULTS["host_mtbf_h"],
        help="first guess of the mean hours between failures of one host (corrected from the run's own failures): "
        "a repaired host stops the group only when that pays (docs/elastic.md); 0 = re-admit at once",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=DEFAULTS["snapshot_every"],
        help="the trainer snapshots its state in host memory, with a copy on the next host, every N steps "
        "(--config.elastic.snapshot_every wins when given)",
    )
    p.add_argument("--no-snapshots", action="store_true", help="no in-memory snapshots: restore from disk only")
    p.add_argument(
        "--no-precompile",
        action="store_true",
        help="do not compile the train step ahead for the next group sizes (done on this machine for CPU hosts)",
    )
    p.add_argument(
        "--no-standby",
        action="store_true",
        help="no warm standby processes (imported, waiting) on the hosts for the next relaunch",
    )
    p.add_argument(
        "--no-fast-recovery",
        action="store_true",
        help="as before the recovery work (for comparisons): every process compiles for itself, no compile-ahead, "
        "no standbys",
    )
    p.add_argument(
        "--in-process-recovery",
        action="store_true",
        help="when a host's process exits, the others go on in their processes as a smaller group (reve_jax/"
        "elastic/inprocess.py: not the coordinator's host; worker scripts that support it, not the trainer yet)",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=30.0,
        help="with --in-process-recovery: s before a collective with a dead peer fails (CPU); it must also cover "
        "every legitimate wait in a collective",
    )
    p.add_argument("--quiet", action="store_true")
    args, rest = cli.parse_args(p, argv)
    if args.no_fast_recovery:
        args.no_precompile = args.no_standby = True
    if args.snapshot_every < 1:
        p.error(f"--snapshot-every {args.snapshot_every}: give a number of steps >= 1, or --no-snapshots")
    return args, rest


def snapshot_override(args, overrides: list[str]) -> list[str]:
    """The `--config.elastic.snapshot_every=N` the launcher adds for the trainer (snapshots on by default), or
    nothing when the config override is given already, snapshots are off, or the worker is not the trainer."""
    given = any(o.startswith("--config.elastic.snapshot_every") for o in overrides)
    if given or args.no_snapshots or not is_trainer(args):
        return []
    return [f"--config.elastic.snapshot_every={args.snapshot_every}"]


def config_hints(config_path: str, overrides: list[str]) -> dict:
    """Returns train.steps, train.ckpt_every, train.global_batch and train.grad_accum of the config, loaded with the
    overrides exactly as scripts/train.py loads it: a config that would fail in the workers (an unknown key, a
    wrong type) fails here, before any worker starts, with SystemExit and the reason."""
    from reve_jax import config as config_lib

    try:
        train = config_lib.load_config(config_path, overrides).train
    except config_lib.ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    return {k: int(train[k]) for k in ("steps", "ckpt_every", "global_batch", "grad_accum")}


def group_sizes(spec: str, num_hosts: int, devices_per_host: int, hints: dict) -> tuple[int, ...]:
    """Returns the allowed group sizes for `spec` ("any", "auto" or "4,2,1"); () means any size."""
    if spec == "any":
        return ()
    if spec != "auto":
        return tuple(sorted(int(s) for s in spec.split(",")))
    batch = hints.get("global_batch", 0) // max(hints.get("grad_accum", 1), 1)
    if not batch or not devices_per_host:
        return ()
    return tuple(n for n in range(1, num_hosts + 1) if batch % (n * devices_per_host) == 0)


# Worker scripts that run reve_jax's trainer, so compile-ahead and warm standbys apply: scripts/train.py, and
# scripts/chaos.py, the chaos soak's worker (the trainer with every step's data positions logged).
TRAINER_SCRIPTS = ("train.py", "chaos.py")


def is_trainer(args) -> bool:
    script = os.path.abspath(args.script)
    return any(script == os.path.join(backends.REPO_ROOT, "scripts", name) for name in TRAINER_SCRIPTS)


def other_checkout(args) -> str | None:
    """A warning when the worker script is a trainer script of another checkout than the reve_jax this process
    imported (an editable install of one checkout, the launcher run from another): its workers would run the
    installed package's code, and compile-ahead and in-memory snapshots, which need the trainer, are off. None when
    the script is this package's trainer, or not a trainer script at all."""
    script = os.path.abspath(args.script)
    if is_trainer(args) or os.path.basename(script) not in TRAINER_SCRIPTS:
        return None
    checkout = os.path.dirname(os.path.dirname(script))
    return (
        f"launch: warning: {script} is not the trainer of the installed reve_jax ({backends.REPO_ROOT}): its "
        f"workers import that package, and compile-ahead and in-memory snapshots are off. Run "
        f"`pip install -e {checkout}` to launch this checkout's code."
    )


def precompile_argv(args, overrides: list[str]) -> list[str]:
    """The compile-ahead job's command line, for the trainer only (another worker script has its own step)."""
    if not is_trainer(args):
        return []
    workdir = os.path.abspath(args.workdir)  # not used by the job; names the run in its command line
    return ["python", "-m", "reve_jax.elastic.precompile", "--config", args.config, "--workdir", workdir, *overrides]


def main(argv: list[str] | None = None) -> int:
    """Runs the launcher; returns the supervisor's exit code (0 finished, 2 stopped, 1 failed)."""
    args, overrides = parse_args(argv)
    if warning := other_checkout(args):
        print(warning, file=sys.stderr, flush=True)
    overrides = [*overrides, *snapshot_override(args, overrides)]
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    local = not args.slurm and args.hosts.isdigit()
    cpu_env = {}  # remote hosts that run JAX on emulated CPU devices
    if (args.slurm or not args.hosts.isdigit()) and args.devices_per_host:
        # This machine's other XLA flags go along (the test bed's hosts are this machine).
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
        cpu_env = {
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={args.devices_per_host}".strip(),
            "JAX_PLATFORMS": "cpu",
        }
    try:
        backend = make_backend(args)
    except (ValueError, RuntimeError) as e:  # a host name ssh would misread, no allocation: one line
        raise SystemExit(f"launch: {e}") from None
    devices = args.gpus_per_host or args.devices_per_host or (2 if local else 0)
    hints = config_hints(args.config, overrides)
    config = PolicyConfig(
        min_hosts=args.min_hosts,
        max_strikes=args.max_strikes,
        group_sizes=group_sizes(args.group_sizes, len(backend.hosts), devices, hints),
        heartbeat_timeout=args.heartbeat_timeout,
        startup_timeout=args.startup_timeout,
        progress_timeout=args.progress_timeout,
        stop_timeout=args.stop_timeout,
        probe_interval=args.probe_interval,
        readmit=not args.no_readmit,
        host_mtbf_s=args.host_mtbf_h * 3600.0,
        ckpt_every=hints.get("ckpt_every", 0),
        total_steps=hints.get("steps", 0),
        fenced=True,  # the supervisor fences every group it gives up on (fence.py)
        in_process=args.in_process_recovery,
    )
    cache = os.path.abspath(args.compile_cache or os.path.join(workdir, "..", "jax_cache"))
    worker = WorkerSettings(
        argv=[
            "python",
            args.script,
            "--config",
            args.config,
            "--workdir",
            workdir,
            *overrides,
            *args.worker_arg,
        ],
        env={
            **cpu_env,
            # A JAX with mTLS for its coordination service reads these on every host (docs/elastic.md).
            **{k: v for k, v in os.environ.items() if k.startswith("JAX_MTLS_")},
            "JAX_COMPILATION_CACHE_DIR": cache,
            **({"REVE_SHARE_EXECUTABLES": "0"} if args.no_fast_recovery else {}),
            **(
                {inprocess.IN_PROCESS_ENV: "1", inprocess.TIMEOUT_ENV: str(int(args.collective_timeout))}
                if args.in_process_recovery
                else {}
            ),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        },
        init_timeout=min(args.startup_timeout, 120.0),
        precompile_argv=[] if args.no_precompile else precompile_argv(args, overrides),
        # The trainer's modules, and TensorBoard's writer, which process 0 would import after the compile.
        standby_imports=""
        if args.no_standby
        else ("reve_jax.train.trainer,tensorboardX" if is_trainer(args) else "jax"),
        devices_per_host=0 if args.gpus_per_host else (args.devices_per_host or (2 if local else 0)),
        # Workers of a supervisor that died (SIGKILL, lost node) stop by themselves instead of running on.
        orphan_timeout=max(60.0, 4 * args.heartbeat_timeout),
    )
    try:
        supervisor = Supervisor(backend, worker, config, workdir, verbose=not args.quiet)
    except RuntimeError as e:  # another launcher on the workdir, a fence that cannot be read: say so, once
        raise SystemExit(f"launch: {e}") from None
    return supervisor.run()


def make_backend(args) -> backends.Backend:
    """The backend the options name: SLURM, local processes (--hosts N) or SSH (--hosts a,b,c)."""
    if args.slurm:
        return backends.SlurmBackend(
            srun_args=tuple(args.srun_arg), advertise=args.advertise, python=args.python or "python3"
        )
    if args.hosts.isdigit():
        return backends.LocalBackend(
            int(args.hosts), args.devices_per_host or 2, args.gpus_per_host, args.python, marker_dir=args.marker_dir
        )
    ssh = ("ssh", *args.ssh_arg)
    return backends.SSHBackend(
        args.hosts.split(","), args.remote_dir, args.python or "python3", advertise=args.advertise, ssh=ssh
    )
