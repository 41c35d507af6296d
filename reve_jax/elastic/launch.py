"""Command line of the elastic launcher (`scripts/launch.py`): one training process per host, kept alive.

    python scripts/launch.py --config configs/x.py --workdir runs/x --hosts 4 [--config.train.steps=100 ...]
    python scripts/launch.py --config configs/x.py --workdir runs/x --hosts node1,node2 --remote-dir /src/reve
    python scripts/launch.py --config configs/x.py --workdir runs/x --slurm      # inside salloc/sbatch

`--hosts N` runs N local processes (each its own emulated CPU devices, or --gpus-per-host GPUs); a comma list
of names uses SSH; --slurm runs one srun step per node of the allocation. Arguments `--config.a.b=v` go to
every worker unchanged.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from reve_jax.elastic import backends
from reve_jax.elastic.policy import PolicyConfig
from reve_jax.elastic.supervisor import Supervisor, WorkerSettings


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
    p.add_argument("--devices-per-host", type=int, default=2, help="local: emulated CPU devices per process")
    p.add_argument("--gpus-per-host", type=int, default=0, help="local: GPUs per process (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--marker-dir", default="", help="local: probe of host h fails while <dir>/h exists")
    p.add_argument("--remote-dir", default=os.getcwd(), help="ssh: checkout directory on the hosts")
    p.add_argument("--advertise", default="", help="address workers use to reach this supervisor")
    p.add_argument("--srun-arg", action="append", default=[], help="slurm: extra srun argument (repeatable)")
    p.add_argument("--compile-cache", default="", help="persistent XLA cache (default <workdir>/../jax_cache)")
    p.add_argument("--min-hosts", type=int, default=1)
    p.add_argument("--max-strikes", type=int, default=3, help="failures after which a host is excluded")
    p.add_argument(
        "--group-sizes",
        default="auto",
        help="allowed hosts per group: comma list, 'any', or 'auto' (the global batch divides)",
    )
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--progress-timeout", type=float, default=120.0, help="s at one training step: hung")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="grace while starting/compiling")
    p.add_argument("--stop-timeout", type=float, default=120.0, help="grace for a clean stop before a kill")
    p.add_argument("--probe-interval", type=float, default=10.0)
    p.add_argument("--no-readmit", action="store_true", help="never re-admit a failed host")
    p.add_argument(
        "--host-mtbf-h",
        type=float,
        default=0.0,
        help="mean hours between failures of one host: a repaired host then stops the group only when that pays "
        "(docs/elastic.md); 0 = re-admit at once",
    )
    p.add_argument("--quiet", action="store_true")
    args, rest = p.parse_known_args(argv)
    unknown = [a for a in rest if not a.startswith("--config.")]
    if unknown:
        p.error(f"unrecognised arguments: {unknown}")
    return args, rest


def config_hints(config_path: str, overrides: list[str]) -> dict:
    """Returns train.steps, train.ckpt_every, train.global_batch and train.grad_accum from the config file and
    the overrides (missing keys, or a config file that cannot be read here, leave them out)."""
    hints = {}
    try:
        spec = importlib.util.spec_from_file_location("_launch_config", config_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        train = module.get_config().train
        hints = {k: int(train[k]) for k in ("steps", "ckpt_every", "global_batch", "grad_accum") if k in train}
    except Exception as e:  # the hints are optional: the run works without them
        print(f"launch: no hints from {config_path} ({type(e).__name__}: {e})")
    for o in overrides:
        key, _, value = o[len("--config.") :].partition("=")
        if key.startswith("train.") and key[len("train.") :] in (
            "steps",
            "ckpt_every",
            "global_batch",
            "grad_accum",
        ):
            hints[key[len("train.") :]] = int(value)
    return hints


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


def main(argv: list[str] | None = None) -> int:
    """Runs the launcher; returns the supervisor's exit code (0 finished, 2 stopped, 1 failed)."""
    args, overrides = parse_args(argv)
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    if args.slurm:
        backend = backends.SlurmBackend(srun_args=tuple(args.srun_arg), advertise=args.advertise)
        devices = args.gpus_per_host
    elif args.hosts.isdigit():
        backend = backends.LocalBackend(
            int(args.hosts),
            args.devices_per_host,
            args.gpus_per_host,
            args.python,
            marker_dir=args.marker_dir,
        )
        devices = args.gpus_per_host or args.devices_per_host
    else:
        backend = backends.SSHBackend(
            args.hosts.split(","), args.remote_dir, args.python or "python3", advertise=args.advertise
        )
        devices = args.gpus_per_host
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
            # A JAX with mTLS for its coordination service reads these on every host (docs/elastic.md).
            **{k: v for k, v in os.environ.items() if k.startswith("JAX_MTLS_")},
            "JAX_COMPILATION_CACHE_DIR": cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        },
        init_timeout=min(args.startup_timeout, 120.0),
        # Workers of a supervisor that died (SIGKILL, lost node) stop by themselves instead of running on.
        orphan_timeout=max(60.0, 4 * args.heartbeat_timeout),
    )
    return Supervisor(backend, worker, config, workdir, verbose=not args.quiet).run()
