"""Executables shared between processes on CPU (reve_jax/xla.py): what one process with 4 devices compiled into the
persistent cache, both processes of a 2 x 2 job load (no compile) and run, an all-reduce across them included;
and a 2-process job compiles once, on process 0. Child processes: the key swap is process-wide."""

import os
import subprocess
import sys
import textwrap

from util import xla_flags

from reve_jax.elastic.backends import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent(
    """
    import sys
    n, i, port, cache = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from reve_jax import xla
    xla.share_executables_between_processes()
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if n > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", n, i, cluster_detection_method="deactivate")
    xla.enable_compile_cache(cache)
    import jax.numpy as jnp, numpy as np
    from jax._src import monitoring
    from jax.sharding import NamedSharding, PartitionSpec as P
    seen = []
    monitoring.register_event_listener(lambda e, **k: seen.append(e.rsplit("/", 1)[-1]))
    mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P("d"))
    f = jax.jit(lambda x: jnp.tanh(x * 2).sum(0), in_shardings=rows, out_shardings=NamedSharding(mesh, P()))
    c = f.lower(jax.ShapeDtypeStruct((jax.device_count(), 4), jnp.float32, sharding=rows)).compile()
    local = np.full((jax.local_device_count(), 4), 0.1 * (i + 1), np.float32)
    out = np.asarray(c(jax.make_array_from_process_local_data(rows, local)).addressable_data(0))
    print("hits", seen.count("cache_hits"), "misses", seen.count("cache_misses"), "out", round(float(out[0]), 5))
    """
)


def run(n: int, devices: int, cache: str) -> list[str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices))
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(n), str(i), port, cache], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(n)
    ]  # fmt: skip
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        outs.append(next(line for line in out.splitlines() if line.startswith("hits")))
    return outs


def test_one_process_compiles_ahead_for_a_two_process_job(tmp_path):
    import numpy as np

    cache = str(tmp_path / "cache")
    (ahead,) = run(1, 4, cache)
    assert ahead.startswith("hits 0 misses 1")
    want = 2 * np.tanh(0.2) + 2 * np.tanh(0.4)  # rows from both processes: the sum crosses them
    for line in run(2, 2, cache):
        assert line.startswith("hits 1 misses 0"), line
        assert float(line.split()[-1]) == round(want, 5) or abs(float(line.split()[-1]) - want) < 1e-4


def test_a_two_process_job_writes_one_entry_both_can_load(tmp_path):
    cache = str(tmp_path / "cache")
    first = run(2, 2, cache)
    assert first[0].startswith("hits 0 misses 1"), first  # process 0 compiled
    # Process 1 never compiles: it receives process 0's executable, or (when process 0 wrote the entry before
    # process 1 looked it up) loads it from the cache: which of the two is a race between the processes.
    assert first[1].startswith(("hits 0 misses 0", "hits 1 misses 0")), first
    assert first[0].split()[-1] == first[1].split()[-1]
    assert len(os.listdir(cache)) == 1  # process 0 compiled and shared it; the key is the same on both
    again = run(2, 2, cache)
    assert all(line.startswith("hits 1 misses 0") for line in again), again
