"""Test set-up: 8 emulated CPU devices, set before JAX initialises its backends, and one persistent XLA compile
cache for the session."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # Many tests, and the train.py processes they start, compile the same tiny programs: compiling was most of
    # the suite's time. A cached executable is the one XLA compiled for the same program and flags (same
    # numerics); programs that compile in under a second are not cached (JAX's default). Tests that study the
    # cache give their processes their own directory. Fresh per session, removed at its end. Under pytest-xdist the
    # controller imports this file first and its workers inherit the variable: one cache for all of them.
    _cache = tempfile.mkdtemp(prefix="reve_jax_tests_xla_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)
