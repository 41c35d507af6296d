"""Processes of one job agree on which checkpoint is damaged before any is moved (finding 6 of the elastic audit).

Each process reads only its own shards, so one can find the newest checkpoint undecodable while another
restores it fine. Before, they then restored different steps, and the one that found damage waited 600 s at a
barrier the others never reached (the run looped, nothing was moved). Two real JAX processes on this machine
(coordination service on 127.0.0.1, one CPU device each): process 1 finds its shards of step 2 undecodable
(a tensorstore DATA_LOSS where it reads them), process 0 does not. Both must restore step 1, and step 2 must be
set aside exactly once.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from util import xla_flags

from reve_jax.elastic import backends

REPO = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from reve_jax import checkpoint
    port, index, workdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, index, heartbeat_timeout_seconds=30)
    checkpoint.BARRIER_TIMEOUT_S = 20  # the old code's wait, shortened: a test must end
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("d"))

    def state(v):
        return {"w": jax.make_array_from_callback((8,), sharding, lambda ix: np.full((8,), v, np.float32)[ix])}

    ckpt = checkpoint.Checkpointer(workdir, async_save=False)
    for step in (1, 2):
        ckpt.save(step, state(float(step)), {"data_position": step})
    ckpt.close()
    if index == 1:  # this process's shards of step 2 cannot be decoded; process 0's can
        real = checkpoint.Checkpointer.restore

        def restore(self, step, abstract_state):
            if step == 2:
                raise ValueError('DATA_LOSS: Error reading "d/5e0a": checksum mismatch')
            return real(self, step, abstract_state)

        checkpoint.Checkpointer.restore = restore
    abstract = {"w": jax.ShapeDtypeStruct((8,), np.float32, sharding=sharding)}
    t0 = time.time()
    try:
        restored, meta = checkpoint.resume(checkpoint.Checkpointer(workdir), abstract)
        w = float(np.asarray(restored["w"].addressable_data(0))[0])
        out = {"step": meta["step"], "w": w}
    except checkpoint.CheckpointError as e:
        out = {"error": str(e)[:300]}
    out["seconds"] = round(time.time() - t0, 1)
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)
    """
)


def test_processes_agree_on_a_damaged_checkpoint_before_moving_it(tmp_path):
    port = backends.free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(port), str(i), str(tmp_path / "run")],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outs = []
    try:
        deadline = time.monotonic() + 150
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            p.kill()
    results = []
    for out in outs:
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, out[-3000:]
        results.append(json.loads(lines[-1][7:]))
    print("results:", results)
    assert [r.get("step") for r in results] == [1, 1], results
    assert [r["w"] for r in results] == [1.0, 1.0]
    assert max(r["seconds"] for r in results) < 15, results  # nobody waited out a barrier
    moved = sorted(p.name for p in (tmp_path / "run" / "checkpoints_corrupt").iterdir())
    assert [m.split(".")[0] for m in moved] == ["2"], moved
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
