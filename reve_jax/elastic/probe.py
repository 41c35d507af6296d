"""Health job for a quarantined host: `python -m reve_jax.elastic.probe` exits 0 if JAX computes correctly on
every local device, non-zero otherwise.

REVE_PROBE_FAIL_MARKER names a file whose presence makes the probe fail: the local backend uses it to
simulate a host that stays broken until "repaired" (the file removed).
"""

import os
import sys


def main() -> int:
    """Returns the exit code: 0 healthy, 1 broken."""
    marker = os.environ.get("REVE_PROBE_FAIL_MARKER", "")
    if marker and os.path.exists(marker):
        print(f"probe: {marker} exists, host marked broken", flush=True)
        return 1
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    want = x @ x.T
    for device in jax.local_devices():
        got = np.asarray(jax.jit(lambda a: a @ a.T)(jax.device_put(jnp.asarray(x), device)))
        if not np.allclose(got, want, rtol=1e-5):
            print(f"probe: wrong result on {device}", flush=True)
            return 1
    print(f"probe: ok on {len(jax.local_devices())} {jax.default_backend()} devices", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
