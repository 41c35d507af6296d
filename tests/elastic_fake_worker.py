"""A stand-in for scripts/train.py in the elastic tests: its command line and worker protocol, a tiny job.

    python tests/elastic_fake_worker.py --config C --workdir W [--config.train.steps=40
        --config.train.ckpt_every=5 --fake.step_time=0.1 --fake.hang=local2:1:12 --fake.rogue=HOST]

Every step all-reduces (psum over every device of every process, gloo on CPU) a value that updates a scalar
state, so a missing process blocks the others as a real data-parallel step would. Process 0 writes the state
atomically to fake_ckpt.json every ckpt_every steps, and each step's value to metrics.jsonl; a start resumes
from the checkpoint. `--fake.hang=HOST:ATTEMPT:N` makes that host's main thread hang after N steps of that
attempt (its heartbeat thread goes on). `--fake.rogue=HOST` makes that host's worker also append a line
{"rogue": HOST, "attempt": A, "time": t} to metrics.jsonl every 0.2 s from a thread of its own, whatever the
all-reduce does: a worker cut off from the others that still writes (the split-brain case fencing must stop).
A stop request is agreed through the same all-reduce, then saved, exit 0. Launched with --in-process-recovery, a
failed all-reduce (a peer died) is followed by an in-process recovery (reve_jax/elastic/inprocess.py): the
survivors agree on the live devices and redo the step on them.
"""

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from reve_jax.elastic import inprocess  # noqa: E402
from reve_jax.elastic.worker import init_from_env  # noqa: E402


def parse(argv: list[str]) -> dict:
    opts = {"workdir": "", "steps": 40, "ckpt_every": 5, "step_time": 0.1, "hang": "", "rogue": ""}
    it = iter(argv)
    for a in it:
        if a == "--workdir":
            opts["workdir"] = next(it)
        elif a == "--config":
            next(it)
        elif a.startswith(("--config.train.", "--fake.")):
            name, _, value = a.partition("=")
            key = name.rpartition(".")[2]
            if key in opts:
                opts[key] = type(opts[key])(value)
    return opts


def save(path: str, step: int, w: float) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"step": step, "w": w}, f)
    os.replace(tmp, path)


def hang_forever() -> None:
    threading.Event().wait()


def append(path: str, record: dict) -> None:
    # Opened for every line, as the trainer's metrics writer does: each write passes the fence (fence.py).
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def rogue_writer(path: str, host: str, attempt: int) -> None:
    while True:
        append(path, {"rogue": host, "attempt": attempt, "time": time.time()})
        time.sleep(0.2)


def main() -> int:
    opts = parse(sys.argv[1:])
    ctx = init_from_env()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ctx.beat(-1, "restoring")
    ckpt = os.path.join(opts["workdir"], "fake_ckpt.json")
    os.makedirs(opts["workdir"], exist_ok=True)
    step, w = 0, 1.0
    if os.path.exists(ckpt):
        with open(ckpt) as f:
            saved = json.load(f)
        step, w = saved["step"], saved["w"]
    print(
        f"process {ctx.process_id}/{ctx.num_processes} on {ctx.host} attempt {ctx.attempt} pid {os.getpid()}: "
        f"from step {step}",
        flush=True,
    )
    ctx.beat(step, "compiling")

    def over(devices):
        mesh = jax.sharding.Mesh(np.asarray(devices), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
        reduce = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=NamedSharding(mesh, P()))
        return NamedSharding(mesh, P("d")), reduce, len(devices)

    sharding, reduce, n_total = over(jax.devices())
    hang_host, hang_attempt, hang_after = (opts["hang"].split(":") + ["", "", ""])[:3]
    first_step = step
    is_main = ctx.process_id == 0
    metrics = os.path.join(opts["workdir"], "metrics.jsonl")
    if ctx.host == opts["rogue"]:
        threading.Thread(target=rogue_writer, args=(metrics, ctx.host, ctx.attempt), daemon=True).start()
    while step < opts["steps"]:
        if ctx.host == hang_host and str(ctx.attempt) == hang_attempt and str(step - first_step) == hang_after:
            hang_forever()
        # Each device contributes (1, stop flag): the sum counts the devices and whether any process must
        # stop.
        local = np.tile(np.array([[1.0, float(ctx.stop_requested())]], np.float32), (jax.local_device_count(), 1))
        try:
            total = np.asarray(reduce(jax.make_array_from_process_local_data(sharding, local)))
        except Exception as e:  # a peer died: with in-process recovery, go on with the live ones
            if not ctx.in_process:
                raise
            print(f"step {step + 1}: {type(e).__name__}: {str(e)[:200]}; recovering in-process", flush=True)
            ctx.recovering()
            sharding, reduce, n_total = over(inprocess.live_devices())
            print(f"live processes now {sorted({d.process_index for d in sharding.mesh.devices.flat})}", flush=True)
            ctx.beat(step, "compiling")
            continue
        n_dev, stop = float(total[0]), total[1] > 0
        w = 0.9 * w + 0.1 * (step % 7) * n_dev / n_total  # independent of the device count
        step += 1
        if is_main:
            append(metrics, {"step": step, "loss": w, "attempt": ctx.attempt, "time": time.time()})
        ctx.beat(step, "train")
        if is_main and (step % opts["ckpt_every"] == 0 or stop or step == opts["steps"]):
            save(ckpt, step, w)
        if stop:
            print(f"stopping at step {step} on request", flush=True)
            break
        time.sleep(opts["step_time"])
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
