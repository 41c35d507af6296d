"""Per-device memory of a config on a mesh, whether it fits a GPU, and the cheapest change that makes it fit.

    python scripts/plan.py --config configs/prx_1b.py --devices 128 --config.mesh.fsdp=16 --config.mesh.tensor=8
    python scripts/plan.py --config configs/prx_1b.py --devices 8 --gpu-mem-gib 80 --config.train.global_batch=2048
    python scripts/plan.py --config configs/tiny.py --devices 8 --config.mesh.fsdp=4 --check-compiled

Shapes only: no weights are built, and the mesh may be far larger than the devices here. --check-compiled
compiles the step on `--devices` emulated CPU devices and prints XLA's memory analysis beside the estimate.
docs/planning.md explains the activation formula and how far to trust it.
"""

from reve_jax.tools.plan.cli import main

if __name__ == "__main__":
    main(doc=__doc__)
