"""A small convolutional autoencoder for latent diffusion: pixels [B, H, W, 3] in [-1, 1] <-> latents
[B, H/f, W/f, C], with f = 2^k.

Encoder: a 3x3 stem, then per level a 3x3 convolution, `res_blocks` residual blocks and a stride-2 3x3 convolution
(channels doubling up to 4x the stem's), a 3x3 convolution, `res_blocks` residual blocks and a 1x1 projection to C
channels. The decoder mirrors it with nearest-neighbour upsampling. SiLU between convolutions. A residual block is
x + conv(silu(conv(silu(x)))) with the second convolution zero-initialised (it starts as the identity), which lets a
deeper autoencoder start like a shallow one. Trained as a fixed-variance VAE (latent.py): the decoder reconstructs
from the latent plus Gaussian noise of std `latent.train_noise` (in units of the latents' own scale), with a small L2
pull on the latents, so that the decoder tolerates the small errors of a diffusion model's samples.

The latents the diffusion model sees are normalised per channel (`shift`, `scale`, measured on the data after
training and stored with the weights), so they have mean 0 and variance 1 like the diffusion noise.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FORMAT = "reve_jax.autoencoder/1"


@dataclasses.dataclass(frozen=True)
class AEConfig:
    """channels: latent channels C; downsample: f (a power of 2); width: the stem's channels; res_blocks: residual
    blocks per level and in the middle (0: the plain convolution stack of files written before they existed)."""

    channels: int = 16
    downsample: int = 4
    width: int = 32
    res_blocks: int = 0

    @property
    def levels(self) -> int:
        return int(math.log2(self.downsample))

    def level_widths(self) -> list[int]:
        """Channels at full resolution and after each downsampling."""
        return [min(self.width * 2**i, 4 * self.width) for i in range(self.levels + 1)]


def _conv(cin: int, cout: int, k: int, rngs: nnx.Rngs, stride: int = 1, zero: bool = False) -> nnx.Conv:
    init = {"kernel_init": nnx.initializers.zeros_init()} if zero else {}
    return nnx.Conv(cin, cout, kernel_size=(k, k), strides=(stride, stride), padding="SAME", rngs=rngs, **init)


class ResBlock(nnx.Module):
    """x + conv(silu(conv(silu(x)))), the second convolution zero-initialised."""

    def __init__(self, width: int, rngs: nnx.Rngs):
        self.conv_a = _conv(width, width, 3, rngs)
        self.conv_b = _conv(width, width, 3, rngs, zero=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.conv_b(jax.nn.silu(self.conv_a(jax.nn.silu(x))))


def _res_stack(width: int, n: int, rngs: nnx.Rngs) -> nnx.List:
    return nnx.List([ResBlock(width, rngs) for _ in range(n)])


def _apply(blocks, h: jax.Array) -> jax.Array:
    for block in blocks:
        h = block(h)
    return h


class Autoencoder(nnx.Module):
    def __init__(self, cfg: AEConfig, *, rngs: nnx.Rngs):
        if cfg.downsample < 1 or 2**cfg.levels != cfg.downsample:
            raise ValueError(f"latent.downsample={cfg.downsample} must be a power of 2")
        self.cfg = cfg
        w = cfg.level_widths()
        self.stem = _conv(3, w[0], 3, rngs)
        n = cfg.res_blocks
        self.down = nnx.List(
            [
                nnx.List([_conv(w[i], w[i], 3, rngs), _conv(w[i], w[i + 1], 3, rngs, stride=2)])
                for i in range(cfg.levels)
            ]
        )
        self.enc_mid = _conv(w[-1], w[-1], 3, rngs)
        self.to_latent = _conv(w[-1], cfg.channels, 1, rngs)
        self.from_latent = _conv(cfg.channels, w[-1], 1, rngs)
        self.dec_mid = _conv(w[-1], w[-1], 3, rngs)
        self.up = nnx.List(
            [
                nnx.List([_conv(w[i + 1], w[i], 3, rngs), _conv(w[i], w[i], 3, rngs)])
                for i in reversed(range(cfg.levels))
            ]
        )
        # Residual blocks (empty lists hold no parameters, so files written without them keep their names).
        self.enc_res = nnx.List([_res_stack(w[i], n, rngs) for i in range(cfg.levels)])
        self.enc_mid_res = _res_stack(w[-1], n, rngs)
        self.dec_mid_res = _res_stack(w[-1], n, rngs)
        self.dec_res = nnx.List([_res_stack(w[i], n, rngs) for i in reversed(range(cfg.levels))])
        self.out = _conv(w[0], 3, 3, rngs)
        # Per-channel normalisation of the latents (set from data after training): z_norm = (z - shift) / scale.
        self.shift = nnx.Variable(jnp.zeros((cfg.channels,), jnp.float32))
        self.scale = nnx.Variable(jnp.ones((cfg.channels,), jnp.float32))

    def encode_raw(self, x: jax.Array) -> jax.Array:
        h = jax.nn.silu(self.stem(x))
        for i, (conv, down) in enumerate(self.down):
            h = _apply(self.enc_res[i], jax.nn.silu(conv(h)))
            h = jax.nn.silu(down(h))
        h = _apply(self.enc_mid_res, jax.nn.silu(self.enc_mid(h)))
        return self.to_latent(h)

    def decode_raw(self, z: jax.Array) -> jax.Array:
        h = jax.nn.silu(self.dec_mid(jax.nn.silu(self.from_latent(z))))
        h = _apply(self.dec_mid_res, h)
        for i, (conv_a, conv_b) in enumerate(self.up):
            b, hh, ww, c = h.shape
            h = jax.image.resize(h, (b, 2 * hh, 2 * ww, c), method="nearest")
            h = _apply(self.dec_res[i], jax.nn.silu(conv_a(h)))
            h = jax.nn.silu(conv_b(h))
        return self.out(h)

    def encode(self, x: jax.Array) -> jax.Array:
        """Images [B, H, W, 3] in [-1, 1] -> normalised latents [B, H/f, W/f, C] (float32)."""
        z = self.encode_raw(x.astype(jnp.float32))
        return (z - self.shift[...]) / self.scale[...]

    def decode(self, z: jax.Array) -> jax.Array:
        """Normalised latents -> images [B, H, W, 3] (about [-1, 1]; not clipped)."""
        return self.decode_raw(z.astype(jnp.float32) * self.scale[...] + self.shift[...])


def encoder_flops_per_image(cfg: AEConfig, h: int, w: int) -> float:
    """Forward FLOPs (2 per multiply-add) of `Autoencoder.encode` on one h x w image."""
    widths = cfg.level_widths()
    res = 2 * cfg.res_blocks  # 3x3 convolutions of the residual blocks, per level and in the middle
    total = 2 * h * w * 9 * 3 * widths[0]
    for i in range(cfg.levels):
        total += (1 + res) * 2 * h * w * 9 * widths[i] * widths[i]
        h, w = h // 2, w // 2
        total += 2 * h * w * 9 * widths[i] * widths[i + 1]
    total += (1 + res) * 2 * h * w * 9 * widths[-1] ** 2 + 2 * h * w * widths[-1] * cfg.channels
    return float(total)


# ---------------------------------------------------------------------------------------------------- Files
def save(model: Autoencoder, path: str | Path, info: dict) -> Path:
    """Write the weights, the architecture and `info` (training record) to one .npz."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = {}
    for keys, value in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]:
        flat["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)] = np.asarray(value)
    meta = {"format": FORMAT, "config": dataclasses.asdict(model.cfg), "info": info}
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **flat)
    tmp.replace(path)  # never a half-written file under the final name
    return path


def load(path: str | Path) -> tuple[Autoencoder, dict]:
    """The autoencoder saved at `path` and its metadata ({"config", "info"}). A missing or foreign file is a
    FileNotFoundError / ValueError that says how to make one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"autoencoder weights {path} not found: train them with scripts/train_autoencoder.py (docs/latent.md)"
        )
    with np.load(path) as z:
        if "__meta__" not in z:
            raise ValueError(f"{path} is not an autoencoder file of reve_jax (no metadata)")
        meta = json.loads(bytes(z["__meta__"]).decode())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}")
        flat = {k: z[k] for k in z.files if k != "__meta__"}
    model = nnx.eval_shape(lambda: Autoencoder(AEConfig(**meta["config"]), rngs=nnx.Rngs(0)))
    state = nnx.to_pure_dict(nnx.state(model))
    leaves = []
    for keys, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)
        if name not in flat or flat[name].shape != leaf.shape:
            raise ValueError(f"{path}: parameter {name} missing or of the wrong shape; the file is damaged")
        leaves.append(jnp.asarray(flat[name]))
    pure = jax.tree.unflatten(jax.tree.structure(state), leaves)
    graphdef, abstract = nnx.split(model)
    nnx.replace_by_pure_dict(abstract, pure)
    return nnx.merge(graphdef, abstract), meta
