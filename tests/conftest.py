"""Test set-up: 8 emulated CPU devices, set before JAX initialises its backends."""

import os

from util import FAST_COMPILE  # util imports no JAX

flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8 {FAST_COMPILE}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)
