"""Times each perceptual loss term as a train step uses it: loss and its gradient with respect to the
predicted image, weights frozen, compiled once. Random weights (the cost does not depend on their values).

    python -m reve_jax.tools.bench.perceptual --size tiny
    python -m reve_jax.tools.bench.perceptual --size real --batch 2 --image 256 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from reve_jax import xla
from reve_jax.perceptual.dinov2 import PRESETS, DinoV2, DinoV2Config
from reve_jax.perceptual.losses import dino_loss, lpips_loss
from reve_jax.perceptual.vgg_lpips import LPIPS, VGG16_CHANNELS


def time_loss_grad(loss_fn, module: nnx.Module, x_hat: jax.Array, x: jax.Array, iters: int) -> tuple[float, float]:
    """Compiles value_and_grad(loss_fn(module, x_hat, x).mean()) w.r.t. x_hat with the module's state as an
    argument. Returns (compile seconds, mean seconds per step over iters runs after one warm-up)."""
    graphdef, state = nnx.split(module)
    step = jax.jit(
        jax.value_and_grad(lambda xh, st: loss_fn(nnx.merge(graphdef, st), xh, x).mean()),
    )
    t0 = time.perf_counter()
    compiled = step.lower(x_hat, state).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(x_hat, state))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = compiled(x_hat, state)
    jax.block_until_ready(out)
    return compile_s, (time.perf_counter() - t0) / iters


def bench(size: str, batch: int, image: int, dtype: jnp.dtype, iters: int) -> list[dict]:
    """Times LPIPS (x0.5 downscale) and DINOv2 (resize to 224, or 56 for tiny) at the given batch and image
    side. size: "tiny" (narrow test networks) or "real" (VGG16, ViT-B/14 with registers). Returns rows."""
    rngs = nnx.Rngs(0)
    if size == "tiny":
        lp = LPIPS((4, 8, 8, 16, 16), dtype=dtype, rngs=rngs)
        cfg = DinoV2Config(width=32, depth=2, num_heads=2, mlp_dim=128, pos_grid=4, num_register_tokens=4)
        dino, dino_size, dino_name = DinoV2(cfg, dtype=dtype, rngs=rngs), 56, "DINOv2 tiny (w32, 2 blocks)"
        lp_name = "LPIPS tiny VGG (4..16 ch)"
    else:
        lp, lp_name = LPIPS(VGG16_CHANNELS, dtype=dtype, rngs=rngs), "LPIPS VGG16"
        dino, dino_size, dino_name = (
            DinoV2(PRESETS["vitb14_reg"], dtype=dtype, rngs=rngs),
            224,
            "DINOv2 ViT-B/14-reg",
        )
    key = jax.random.key(0)
    x = jax.random.uniform(key, (batch, image, image, 3), minval=-1, maxval=1)
    x_hat = jnp.clip(x + 0.1 * jax.random.normal(jax.random.fold_in(key, 1), x.shape), -1, 1)
    rows = []
    for name, fn, mod, detail in (
        (lp_name, lambda m, a, b: lpips_loss(m, a, b, downscale=0.5), lp, f"{image // 2}px"),
        (dino_name, lambda m, a, b: dino_loss(m, a, b, size=dino_size), dino, f"{dino_size}px"),
    ):
        compile_s, step_s = time_loss_grad(fn, mod, x_hat, x, iters)
        rows.append(dict(term=name, batch=batch, image=image, at=detail, compile_s=compile_s, step_s=step_s))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--image", type=int, default=256)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    dev = jax.devices()[0]
    print(f"# {xla.cpu_model()}, {dev.platform} {dev.device_kind}, {jax.device_count()} device(s), dtype {args.dtype}")
    print("| term | batch | image | net input | compile s | loss+grad per step, ms | per sample, ms |")
    print("|---|---|---|---|---|---|---|")
    for r in bench(args.size, args.batch, args.image, jnp.dtype(args.dtype), args.iters):
        print(
            f"| {r['term']} | {r['batch']} | {r['image']} | {r['at']} | {r['compile_s']:.1f} | "
            f"{1e3 * r['step_s']:.1f} | {1e3 * r['step_s'] / r['batch']:.1f} |"
        )


if __name__ == "__main__":
    main()
