"""Test set-up: 8 emulated CPU devices compiled for fast compiles, set before JAX initialises its backends, and one
persistent XLA compile cache for the session."""

import atexit
import os
import shutil
import tempfile

import pytest
from util import xla_flags

from reve_jax.xla import FAST_COMPILE_FLAGS

# Read when JAX makes its backends, so set before any test runs. The tests check what programs compute; compiling is
# most of their time, and LLVM's optimisation passes were ~40% of it. Subprocesses inherit these flags (those that set
# their own use util.xla_flags); tests/test_learning.py's run leaves them out: it trains 500 steps.
_flags = os.environ.get("XLA_FLAGS", "")
if FAST_COMPILE_FLAGS not in _flags:  # under pytest-xdist the workers inherit the controller's
    os.environ["XLA_FLAGS"] = f"{_flags} {xla_flags(8)}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # Many tests, and the train.py processes they start, compile the same tiny programs: compiling was most of
    # the suite's time. A cached executable is the one XLA compiled for the same program and flags (same
    # numerics). Tests that study the cache give their processes their own directory. Fresh per session, removed
    # at its end. Under pytest-xdist the controller imports this file first and its workers inherit the variable:
    # one cache for all of them.
    _cache = tempfile.mkdtemp(prefix="reve_jax_tests_xla_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # Every program, not only those that compile in over a second (JAX's default): most of the suite's programs
    # are tiny and compiled again by many tests and subprocesses.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)
# jax was imported above (util, reve_jax.xla) before these variables were set, so its options read them here; the
# pytest-xdist workers start with them set, a plain `pytest` process does not.
jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs", float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 1))
)


# The files whose tests run longest (minutes of subprocess training each), measured on the 2-core CI machine. Under
# `-n 2 --dist loadfile` each file goes to one worker; they start first, so the many short files fill in around
# them instead of one long file starting last on a worker while the other sits idle.
LONG_FIRST = (
    "test_learning.py",
    "test_elastic_chaos.py",
    "test_elastic_e2e.py",
    "test_elastic_netns.py",
    "test_convert.py",
    "test_eval_scoring.py",
    "test_checkpoint_safety.py",
    "test_speedup.py",
    "test_train.py",
    "test_prepare_data.py",
    "test_recipe.py",
    "test_sharding.py",
)


def pytest_configure(config):
    # pytest-xdist would hand out files by their number of tests (its --loadscope-reorder default), which puts the
    # one-test files above, the longest, last: keep the collection order set below instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return LONG_FIRST.index(name) if name in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # stable: the other files, and the tests within a file, keep their order


@pytest.fixture
def launched():
    """Starts elastic launchers (test_elastic_e2e.Launcher) for a test and kills whatever is left of them after."""
    from test_elastic_e2e import Launcher

    started = []

    def start(*a, **kw):
        started.append(Launcher(*a, **kw))
        return started[-1]

    yield start
    for launcher in started:
        launcher.kill()
