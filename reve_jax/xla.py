"""XLA runtime settings shared by the trainer and the benchmarks."""

from __future__ import annotations

from pathlib import Path

import jax


def enable_compile_cache(path: str | Path) -> None:
    """Persist compiled XLA programs under `path`, so a restarted process with the same program (an elastic
    relaunch, a resumed run) loads the executable instead of compiling it again."""
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
