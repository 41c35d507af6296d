"""XLA runtime settings shared by the trainer, the elastic workers and the benchmarks."""

from __future__ import annotations

import functools
import threading
import warnings
from pathlib import Path

import jax

# XLA flags for programs whose compile time is most of their cost (the tests, the chaos soak, the recovery
# benchmarks on CPU): LLVM's optimisation passes off. Compiles about 40% faster (tests/test_model.py's scan tests:
# 49 s -> 30 s on 2 cores); a long run wants them on (its steps run slower). Not bit-for-bit the default build: the
# feature net's training (perceptual/shapes.py) reached NaN at step 2 under them, tests/test_eval.py says why.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def enable_compile_cache(path: str | Path) -> None:
    """Persist compiled XLA programs under `path`, so a restarted process with the same program (an elastic
    relaunch, a resumed run) loads the executable instead of compiling it again."""
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def share_executables_between_processes() -> None:
    """Lets every process of a multi-process CPU job use one compiled executable: the one process 0 compiles
    (shared through JAX's coordination service, so the others wait instead of compiling the same program), or
    one found in the persistent cache, also one written by a single process that had as many devices
    (`reve_jax.elastic.precompile`: compiling ahead for the next group size).

    JAX can do both (`jax_share_binary_between_hosts`, the persistent cache), but on CPU its cache key holds
    each process's own topology fingerprint and the global device ids, so no two processes, and no
    single-process compile, ever share a key (measured: only process 0 hit the cache after a relaunch). Here the
    key of a CPU program hashes the platform, the device count and kinds and this machine's CPU instead, and
    leaves the device assignment out, as JAX already does for GPUs: a loaded executable takes the device
    assignment of the process that loads it (checked: a 1-process x 4-device executable computes the right
    all-reduce in a 2 x 2 job). GPU and TPU keys are untouched. Call before the first compile; idempotent.
    """
    from jax._src import cache_key, compilation_cache

    get = compilation_cache.get_cache_key
    if getattr(get, "_reve_cpu_invariant", False):
        return
    if not all(hasattr(cache_key, n) for n in _KEY_PARTS + ("_hash_string",)):
        # Another JAX: keys stay per process (each compiles for itself), and sharing, which needs equal keys on
        # CPU, stays off: slower relaunches, never a process waiting for an executable no one sends.
        warnings.warn(f"jax {jax.__version__}: cache-key internals moved; executables are not shared", stacklevel=2)
        return
    compilation_cache.get_cache_key = _cpu_invariant_key(get)
    jax.config.update("jax_share_binary_between_hosts", True)


_KEY_PARTS = ("_hash_serialized_compile_options", "_hash_accelerator_config")  # what the CPU key swaps
_key_lock = threading.Lock()  # the key helpers are swapped for the call: one key at a time


def _cpu_invariant_key(get):
    from jax._src import cache_key

    @functools.wraps(get)
    def key(module, devices, options, backend, *args, **kwargs):
        if backend.platform != "cpu":
            return get(module, devices, options, backend, *args, **kwargs)
        opts, accel = cache_key._hash_serialized_compile_options, cache_key._hash_accelerator_config

        def without_assignment(hash_obj, compile_options, strip_device_assignment=False):
            return opts(hash_obj, compile_options, strip_device_assignment=True)

        def this_cpu(hash_obj, accelerators):
            devs = list(accelerators.flat)
            kinds = ",".join(sorted({d.device_kind for d in devs}))
            cache_key._hash_string(hash_obj, f"cpu:{len(devs)}:{kinds}:{_cpu_signature()}")

        with _key_lock:
            cache_key._hash_serialized_compile_options = without_assignment
            cache_key._hash_accelerator_config = this_cpu
            try:
                return get(module, devices, options, backend, *args, **kwargs)
            finally:
                cache_key._hash_serialized_compile_options, cache_key._hash_accelerator_config = opts, accel

    key._reve_cpu_invariant = True
    return key


@functools.cache
def _cpu_info() -> tuple[str, str]:
    """This machine's CPU model name and sorted instruction-set flags, from /proc/cpuinfo where there is one."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    if not model:
        import platform

        model = platform.processor() or platform.machine()
    return model, flags


def cpu_model() -> str:
    """This machine's CPU model name (e.g. "AMD EPYC 7B13"): what a CPU timing was measured on."""
    return _cpu_info()[0]


def _cpu_signature() -> str:
    """This machine's CPU model and instruction-set flags: XLA compiles CPU code for the host's features, so an
    executable must not move to a machine without them."""
    model, flags = _cpu_info()
    return f"{model}|{flags}"
