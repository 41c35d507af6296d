"""Small configs for tests: a few-thousand-parameter DiT on 16 px images that compiles in seconds."""

import importlib.util
from pathlib import Path

from reve_jax.config import apply_override, load_config, validate
from reve_jax.xla import FAST_COMPILE_FLAGS

# The test job's own choices on configs/tiny.py (a config given as `base` keeps its own): AdamW, as tiny.py's Muon
# compiles its Newton-Schulz iterations for long (the tests that need Muon say so), and no end-of-run scoring of
# sample.score_num captions per caption set (tests/test_learning.py scores).
JOB = ("optim.name='adamw'", "sample.score_num=0")
TINY = [
    "model.width=32",
    "model.depth=2",
    "model.heads=2",
    "model.patch=4",
    "model.bottleneck=8",
    "model.dtype='float32'",
    "text.width=32",
    "text.depth=1",
    "text.heads=2",
    "text.max_len=16",
    "data.image_size=16",
    "data.max_objects=1",
    "data.worker_threads=0",
    "train.global_batch=8",
    "train.steps=4",
    "train.log_every=2",
    "train.ckpt_every=2",
    "train.sample_every=0",
    "train.ckpt_async=False",
    "sample.num=0",  # no sample grid at the end of a run (its sampler compiled in every run): the grid tests set it
    "sample.steps=2",
    "optim.warmup_steps=2",
    "optim.schedule='constant'",  # tiny.py's cosine spans train.steps: runs of different lengths would not compare
    "ema.decays=(0.9,)",
    *JOB,
]


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test's subprocess: compiled fast (the tests check values, not speed), `devices` CPU devices
    (None: the launcher or the process sets its own count)."""
    count = f" --xla_force_host_platform_device_count={devices}" if devices else ""
    return FAST_COMPILE_FLAGS + count


def tiny_config(*overrides: str, base: str = "configs/tiny.py"):
    """The test config: configs/tiny.py (or `base`) shrunk by TINY, then `overrides` ("a.b=value")."""
    cfg = load_config(base)
    for item in TINY:
        if base == "configs/tiny.py" or item not in JOB:
            apply_override(cfg, item)
    for item in overrides:
        apply_override(cfg, item)
    validate(cfg)
    return cfg


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package), so a test can call its main(argv)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
