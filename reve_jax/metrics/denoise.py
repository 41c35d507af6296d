"""What a model does with an input that is almost clean: its prediction x_hat for held-out images noised at fixed
times t (t = 1 is clean), against returning the input itself, and with each image given another image's caption.

A denoiser that has learned the data returns the clean image where z = t x + (1 - t) noise is nearly x, so near
t = 1 its x-MSE falls towards the input's own, (1 - t)^2 E[(noise - x)^2]. A model that paints a caption-conditioned
template ignores z: its x-MSE is the same at every t, and with the wrong caption it paints the wrong image. Where a
caption fixes its image (the procedural dataset's `fixed` rendering) the template is the ideal answer and its
x-MSE can go to 0 at every t; then the x-MSE and the reader's columns below, not the caption swap, tell a finished
template from an unfinished one (docs/tiny.md: the old tiny default's template had no shape yet, x-MSE 0.0022 at
every t and shape read at chance from the caption alone; a run whose rate stayed high to step 4,000 learned it).

`probe(cfg, graphdef, params, times, n, seed)` returns, per time t, the mean x-MSE over the held-out images of
the model (`denoise_mse_t<t>`), of the input z (`denoise_input_mse_t<t>`) and of the model with the captions
rolled by one image (`denoise_swapped_mse_t<t>`), and the images for a grid. Pixel-space runs only. On the
procedural dataset it also reads each x_hat with the caption reader (data/synthetic/alignment.py):
`denoise_align_<attribute>_t<t>` says what the one-step answer draws at that time. At t = 0 the input is pure noise
and x_hat is what the caption alone makes the model draw: an attribute read at chance there is one the model does
not take from the caption.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reve_jax import diffusion, latent
from reve_jax.data import pipeline
from reve_jax.data.synthetic import alignment
from reve_jax.metrics import vloss

DEFAULT_TIMES = (0.5, 0.7, 0.85, 0.95, 0.99)
_READ = ("position", "color", "shape", "size", "overall")  # the reader's columns of the table


def denoised(apply: Callable, images, text, noise_t, t, dcfg) -> tuple[jax.Array, jax.Array]:
    """(z, x_hat) for `images` noised with `noise_t` at the scalar time `t`: the input and the model's answer."""
    tb = jnp.full((images.shape[0],), t, jnp.float32)
    z = diffusion.interpolate(images, noise_t, tb)
    return z, diffusion.to_x_v(apply(z, tb, text), z, tb, dcfg.prediction, dcfg.t_eps)[0]


def rolled(text: dict) -> dict:
    """Each image's caption replaced by the previous image's (the first gets the last's)."""
    return jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), text)


def mse_per_time(apply: Callable, images, text, noise, times, dcfg) -> dict[str, jax.Array]:
    """x-MSE per time, each f32 [T]: "model", "input" (x_hat = z) and "swapped" (the captions rolled by one); and
    the answers themselves, "x_hat" f32 [T, B, S, S, 3].

    apply(z [B,S,S,3], t [B], text) -> the network output (per `dcfg.prediction`); images f32 [B,S,S,3]; text a
    dict of [B, ...] arrays; noise [T,B,S,S,3] already scaled; times [T]."""

    def mse(a):
        return jnp.mean(jnp.square(a - images))

    def one(noise_t, t):
        z, x_hat = denoised(apply, images, text, noise_t, t, dcfg)
        return mse(x_hat), mse(z), mse(denoised(apply, images, rolled(text), noise_t, t, dcfg)[1]), x_hat

    model, inp, swap, x_hat = jax.lax.map(lambda a: one(*a), (noise, times))
    return {"model": model, "input": inp, "swapped": swap, "x_hat": x_hat}


def probe(
    cfg, graphdef, params, times: Sequence[float] = DEFAULT_TIMES, n: int = 64, seed: int = 0, grid: int = 8
) -> tuple[dict[str, float], np.ndarray]:
    """The table of the module docstring for `params` of the model `graphdef` of `cfg`, on the first `n` samples
    of the first evaluation split (pipeline.eval_splits) with noise from `seed`, and a grid f32 [(2 + 2 T) S,
    grid S, 3] in [-1, 1]: the first `grid` clean images, then per t the noisy input and x_hat, then x_hat at the
    last t with the rolled captions."""
    if latent.enabled(cfg):
        raise ValueError(
            f"the denoising probe works in pixel space; this run diffuses the latents of {cfg.latent.path} "
            "(latent.path): score it with scripts/evaluate.py without --denoise"
        )
    if any(not 0.0 <= t < 1.0 for t in times):
        raise ValueError(f"--denoise times {tuple(times)} must lie in [0, 1) (t = 1 is the clean image)")
    split = pipeline.eval_splits(cfg.data)[0]
    batch = vloss.eval_batch(cfg, n, split)
    images = batch["image"]
    text = {k: batch[k] for k in ("tokens", "text_emb", "text_mask") if k in batch}
    noise, ts = vloss.fixed_inputs(images.shape, times, cfg.diffusion.noise_scale, seed)
    dcfg = cfg.diffusion

    @jax.jit
    def run(params, images, text, noise, ts):
        model = nnx.merge(graphdef, params)

        def apply(z, t, txt):
            return model(z, t, txt, drop=jnp.zeros((z.shape[0],), bool))[0]

        table = mse_per_time(apply, images, text, noise, ts, dcfg)
        k = min(grid, images.shape[0])
        img = images[:k]
        rows = [img]
        for i in range(len(times)):  # the input and the table's answer for the first k images
            rows += [diffusion.interpolate(img, noise[i, :k], jnp.full((k,), ts[i])), table["x_hat"][i, :k]]
        other = jax.tree.map(lambda a: a[:k], rolled(text))  # the table's roll: image 0 gets image n-1's caption
        rows.append(denoised(apply, img, other, noise[-1, :k], ts[-1], dcfg)[1])
        return table, jnp.stack(rows)

    table, rows = jax.device_get(run(params, images, text, noise, ts))
    out = {}
    for key, name in (("model", "denoise_mse"), ("input", "denoise_input_mse"), ("swapped", "denoise_swapped_mse")):
        out.update({f"{name}_t{t:g}": float(v) for t, v in zip(times, np.asarray(table[key]), strict=True)})
    if cfg.data.name == "synthetic":
        out.update(read_per_time(cfg, batch["index"], np.asarray(table["x_hat"]), times, split))
    r, k, s = rows.shape[0], rows.shape[1], rows.shape[2]
    grid_img = np.clip(np.asarray(rows), -1.0, 1.0).transpose(0, 2, 1, 3, 4).reshape(r * s, k * s, 3)
    return out, grid_img


def read_per_time(cfg, index, x_hat: np.ndarray, times: Sequence[float], split: str) -> dict[str, float]:
    """The caption reader's scores of the answers x_hat [T, B, S, S, 3] (in [-1, 1]) to samples `index` [B] of the
    procedural dataset's evaluation split `split` at each time: {"denoise_align_<attribute>_t<t>": fraction
    correct}."""
    ds = pipeline.eval_dataset(cfg.data, split)
    scenes = [ds.scene(int(i)) for i in index]
    out = {}
    for t, answers in zip(times, x_hat, strict=True):
        out.update({f"denoise_{k}_t{t:g}": v for k, v in alignment.score(answers, scenes).items()})
    return out


def format_table(result: dict[str, float], times: Sequence[float]) -> str:
    """The probe's numbers as a text table, a row per time; with the reader's columns where it read x_hat."""
    read = bool(times) and f"denoise_align_overall_t{times[0]:g}" in result
    head = f"{'t':>6s} {'model x-MSE':>12s} {'input x-MSE':>12s} {'other caption':>14s}"
    lines = [head + ("  | x_hat read: " + " ".join(f"{a:>8s}" for a in _READ) if read else "")]
    for t in times:
        m, i, w = (result[f"{name}_t{t:g}"] for name in ("denoise_mse", "denoise_input_mse", "denoise_swapped_mse"))
        line = f"{t:6.2f} {m:12.5f} {i:12.5f} {w:14.5f}"
        if read:
            line += "  |" + " " * 12 + " ".join(f"{result[f'denoise_align_{a}_t{t:g}']:8.2f}" for a in _READ)
        lines.append(line)
    return "\n".join(lines)
