"""A stand-in for scripts/train.py in the elastic tests: its command line and worker protocol, a tiny job.

    python tests/elastic_fake_worker.py --config C --workdir W [--config.train.steps=40
        --config.train.ckpt_every=5 --fake.step_time=0.1 --fake.hang=local2:1:12 --fake.rogue=HOST
        --fake.one_sided=local0:0:20,local1:1:40]

Every step all-reduces (psum over every device of every process, gloo on CPU) a value that updates a scalar
state, so a missing process blocks the others as a real data-parallel step would. Process 0 writes the state
atomically to fake_ckpt.json every ckpt_every steps, and each step's value to metrics.jsonl; a start resumes
from the checkpoint. `--fake.hang=HOST:ATTEMPT:N` makes that host's main thread hang after N steps of that
attempt (its heartbeat thread goes on). `--fake.rogue=HOST` makes that host's worker also append a line
{"rogue": HOST, "attempt": A, "time": t} to metrics.jsonl every 0.2 s from a thread of its own, whatever the
all-reduce does: a worker cut off from the others that still writes (the split-brain case fencing must stop).
A stop request is agreed through the same all-reduce, then saved, exit 0. Launched with --in-process-recovery, a
failed all-reduce (a peer died) is followed by an in-process recovery (reve_jax/elastic/inprocess.py): the
survivors agree on the live devices and on the last step all of them completed (a process a step ahead rolls back
its state by one), and redo the steps from there; when nobody was lost (inprocess.Regroup) process 0 saves the
agreed state and every process exits 1 for a relaunch. `--fake.one_sided=HOST:ATTEMPT:STEP,...` stands in for a
collective that ends on one side only (a gloo timeout under CPU starvation): at that step of that attempt HOST's
all-reduce raises as if it timed out, while the other hosts skip it and take the result it would have had.
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
    opts = {"workdir": "", "steps": 40, "ckpt_every": 5, "step_time": 0.1, "hang": "", "rogue": "", "one_sided": ""}
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


def saved_step(path: str) -> int:
    if not os.path.exists(path):
        return -1
    with open(path) as f:
        return json.load(f)["step"]


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
    one_sided = {}  # step -> the host whose side of that step's all-reduce fails, this attempt
    for spec in filter(None, opts["one_sided"].split(",")):
        host, attempt, n = spec.split(":")
        if attempt == str(ctx.attempt):
            one_sided[int(n)] = host
    first_step = step
    is_main = ctx.process_id == 0
    metrics = os.path.join(opts["workdir"], "metrics.jsonl")
    if ctx.host == opts["rogue"]:
        threading.Thread(target=rogue_writer, args=(metrics, ctx.host, ctx.attempt), daemon=True).start()
    agreement = inprocess.Agreement(ctx.process_id, ctx.num_processes) if ctx.in_process else None
    before = (step, w)  # the state a step ago: a process ahead of the others rolls back to it
    logged = step  # the last step written to metrics.jsonl (a step redone after a roll-back is not written again)

    def regroup_exit() -> int:
        ctx.close()
        return 1

    def recover(why: str) -> bool:
        """True: go on with the survivors; False: nobody was lost, the group exits for a relaunch."""
        nonlocal sharding, reduce, n_total, step, w
        print(f"step {step + 1}: {why}; recovering in-process", flush=True)
        ctx.recovering()
        try:
            agreed = agreement.recover(step, sharding.mesh.devices.flat)
        except inprocess.Regroup as e:
            agreed, regroup = None, e
        target = agreed.step if agreed else regroup.step
        if target < step:
            step, w = before
            print(f"rolled back to step {step}, the last one every survivor completed", flush=True)
        if agreed is None:
            print(f"regroup: {regroup}", flush=True)
            if is_main and step > saved_step(ckpt):  # a newer one (this process was ahead) is complete: kept
                save(ckpt, step, w)
            return False
        sharding, reduce, n_total = over(agreed.devices)
        print(f"live processes now {sorted({d.process_index for d in agreed.devices})}", flush=True)
        ctx.beat(step, "compiling")
        return True

    while True:
        while step < opts["steps"]:
            if ctx.host == hang_host and str(ctx.attempt) == hang_attempt and str(step - first_step) == hang_after:
                hang_forever()
            # Each device contributes (1, stop flag): the sum counts the devices and whether any process must
            # stop.
            local = np.tile(np.array([[1.0, float(ctx.stop_requested())]], np.float32), (jax.local_device_count(), 1))
            try:
                if one_sided.get(step + 1) is not None and ctx.in_process:
                    failing = one_sided.pop(step + 1)
                    if failing == ctx.host:
                        raise TimeoutError(f"--fake.one_sided: {failing}'s all-reduce timed out on this side only")
                    total = np.array([n_total, 0.0], np.float32)  # the result the all-reduce would have had
                else:
                    total = np.asarray(reduce(jax.make_array_from_process_local_data(sharding, local)))
            except Exception as e:  # a peer died: with in-process recovery, go on with the live ones
                if not ctx.in_process:
                    raise
                if not recover(f"{type(e).__name__}: {str(e)[:200]}"):
                    return regroup_exit()
                continue
            n_dev, stop = float(total[0]), total[1] > 0
            before = (step, w)
            w = 0.9 * w + 0.1 * (step % 7) * n_dev / n_total  # independent of the device count
            step += 1
            if is_main and step > logged:
                append(metrics, {"step": step, "loss": w, "attempt": ctx.attempt, "time": time.time()})
                logged = step
            ctx.beat(step, "train")
            if is_main and (step % opts["ckpt_every"] == 0 or stop or step == opts["steps"]):
                save(ckpt, step, w)
            if stop:
                print(f"stopping at step {step} on request", flush=True)
                break
            time.sleep(opts["step_time"])
        if agreement is None or agreement.finish(step):
            break
        if not recover("a peer recovers from a step this process completed"):
            return regroup_exit()
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
