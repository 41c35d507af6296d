"""Compile the train step ahead for a group size that is not running yet, into the persistent compilation cache.

    python -m reve_jax.elastic.precompile --config C [--config.k=v ...]

Run by the supervisor as one low-priority process with as many emulated CPU devices as the next group would
have (XLA_FLAGS, JAX_COMPILATION_CACHE_DIR set by the caller). It builds the run exactly as the trainer does
(`builder.build(cfg)`: same config, same mesh shape over that many devices) and compiles the step for every
image shape the data gives. With `xla.share_executables_between_processes` the cache key does not depend on
the process layout, so when a host fails and the group relaunches on one host fewer, every new process loads
this executable instead of compiling (measured in docs/elastic.md).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from reve_jax import cli
from reve_jax.elastic import backends


def main(argv: list[str] | None = None) -> int:
    """Returns 0 once every shape is compiled and in the cache."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--workdir", default="", help="the run's (unused: it names the run in the command line)")
    args, overrides = cli.parse_args(p, argv)
    from reve_jax import xla

    xla.share_executables_between_processes()
    import jax

    from reve_jax.train import builder

    cfg = cli.load_config_or_exit(args.config, overrides)
    t0 = time.perf_counter()
    run = builder.build(cfg)
    shapes = run.image_shapes()
    for hw in shapes:
        run.compile(hw)
    print(
        f"precompile: {len(shapes)} step shapes for {jax.device_count()} devices in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return 0


class AheadCompiler:
    """The supervisor's side: compiles ahead, one job at a time on this machine at low priority, for the group
    sizes the policy expects next. `argv` is the job's command line (python -m reve_jax.elastic.precompile
    --config C overrides...), `env` the workers' extra variables, `devices_per_host` the CPU devices a host
    emulates (the job gets that many per host), `log_dir` where each job logs."""

    def __init__(self, argv: list[str], env: dict, devices_per_host: int, log_dir: str, python: str = ""):
        self.argv, self.env, self.devices_per_host, self.log_dir = argv, env, devices_per_host, log_dir
        self.python = python or sys.executable
        self.done: set[int] = set()  # sizes compiled (or tried) in this run
        self._queue: list[int] = []
        self._job: tuple[int, backends.Proc, float] | None = None

    def want(self, sizes: list[int]) -> None:
        """Queues the sizes not compiled, queued or running yet."""
        running = {self._job[0]} if self._job else set()
        self._queue += [s for s in sizes if s not in self.done | running | set(self._queue)]

    def poll(self, now: float) -> list[dict]:
        """Starts the next job when none runs; returns a record for each job that ended."""
        out = []
        if self._job is not None:
            size, proc, started = self._job
            code = proc.poll()
            if code is None:
                return out
            self._job = None
            self.done.add(size)
            out.append({"hosts": size, "devices": size * self.devices_per_host, "code": code,
                        "seconds": round(now - started, 2)})  # fmt: skip
        if self._queue:
            size = self._queue.pop(0)
            argv = ["nice", "-n", "10", *[self.python if a == "python" else a for a in self.argv]]
            log = os.path.join(self.log_dir, f"precompile_{size}hosts.log")
            self._job = (size, backends.spawn(argv, self._job_env(size), log, None), now)
        return out

    def _job_env(self, size: int) -> dict:
        # The workers' XLA flags (part of the cache key) with the device count of the whole group.
        flags = self.env.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
        flags = f"{flags} --xla_force_host_platform_device_count={size * self.devices_per_host}".strip()
        path = os.pathsep.join(p for p in (backends.REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, **self.env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, "PYTHONPATH": path}

    def close(self) -> None:
        if self._job is not None:
            self._job[1].kill()
            self._job = None


if __name__ == "__main__":
    sys.exit(main())
