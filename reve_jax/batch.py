"""The batch: its keys, shapes and dtypes for a config and an image shape, a random batch of that spec, and the
host-to-device transfer. Every producer and consumer of batches (the input pipeline, the trainer, the benchmarks,
the memory planner, the tests) goes through here, so they cannot drift apart.

A batch is a dict of arrays with a leading batch dimension B:

    image      uint8   [B, H, W, 3]   pixels; the train step maps them to [-1, 1] (`diffusion.to_unit`)
    tokens     int32   [B, L]         built-in tokenizer ids (text.encoder='builtin')
    text_emb   float32 [B, L, D]      frozen-encoder embeddings (text.encoder='precomputed'), D = text.emb_dim
    text_mask  bool    [B, L]         valid caption tokens, L = text.max_len

The pipeline also yields `index` (int64 [B], each sample's index in its dataset) for reading captions back on
the host; it never goes to the device (`to_device` drops it).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from reve_jax import sharding
from reve_jax.data import tokenizer

IMAGE_CHANNELS = 3
HOST_ONLY = ("index",)


def text_key(cfg) -> str:
    """'tokens' for the built-in text encoder, 'text_emb' for precomputed embeddings."""
    return "text_emb" if cfg.text.encoder == "precomputed" else "tokens"


def image_shape(cfg, hw: tuple[int, int] | None = None) -> tuple[int, int]:
    """(H, W) of a batch: `hw`, or data.image_size squared."""
    return tuple(hw) if hw is not None else (cfg.data.image_size, cfg.data.image_size)


def model_shape(cfg, hw: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """(h, w, channels) of what the diffusion model denoises for images of shape `hw`: the pixels, or the
    autoencoder's latents (latent.downsample smaller, latent.channels deep) when latent.path is set."""
    h, w = image_shape(cfg, hw)
    if cfg.latent.path:
        f = cfg.latent.downsample
        return h // f, w // f, cfg.latent.channels
    return h, w, IMAGE_CHANNELS


def spec(cfg, hw: tuple[int, int] | None = None, batch_size: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """Keys, shapes and dtypes of the device batch of `cfg` for images of shape `hw` (default data.image_size);
    `batch_size` defaults to train.global_batch."""
    b = cfg.train.global_batch if batch_size is None else batch_size
    h, w = image_shape(cfg, hw)
    L = cfg.text.max_len
    out = {"image": jax.ShapeDtypeStruct((b, h, w, IMAGE_CHANNELS), np.uint8)}
    if text_key(cfg) == "tokens":
        out["tokens"] = jax.ShapeDtypeStruct((b, L), np.int32)
    else:
        out["text_emb"] = jax.ShapeDtypeStruct((b, L, cfg.text.emb_dim), np.float32)
    out["text_mask"] = jax.ShapeDtypeStruct((b, L), np.bool_)
    return out


def abstract(cfg, mesh: Mesh, hw: tuple[int, int] | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """`spec` with each leaf's sharding on `mesh` (batch dimension over the data-parallel axes): the shapes a
    train step is compiled for before any data exists."""
    return {
        k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding.batch_sharding(mesh, len(s.shape)))
        for k, s in spec(cfg, hw).items()
    }


def random(cfg, hw: tuple[int, int] | None = None, seed: int = 0, batch_size: int | None = None) -> dict:
    """A host batch of `spec(cfg, hw, batch_size)` with random content: every pixel value, caption lengths 1..L,
    token ids outside the padding id. For benchmarks and tests that need no real data."""
    rng = np.random.default_rng(seed)
    shapes = spec(cfg, hw, batch_size)
    b, L = shapes["text_mask"].shape
    mask = np.arange(L)[None] < rng.integers(1, L + 1, b)[:, None]
    out = {"image": rng.integers(0, 256, shapes["image"].shape, dtype=np.uint8), "text_mask": mask}
    if "tokens" in shapes:
        out["tokens"] = (rng.integers(2, tokenizer.VOCAB_SIZE, (b, L)) * mask).astype(np.int32)
    else:
        out["text_emb"] = rng.standard_normal(shapes["text_emb"].shape).astype(np.float32) * mask[..., None]
    return out


def check(cfg, local: dict, global_batch: int, num_processes: int = 1) -> None:
    """Raise ValueError naming the key when a host batch does not match the spec (a wrong pipeline, a stale
    shard format): a clear error here instead of a shape error deep inside the compiled step."""
    hw = tuple(local["image"].shape[1:3]) if "image" in local else None
    want = spec(cfg, hw, global_batch // num_processes)
    for k, s in want.items():
        if k not in local:
            raise ValueError(f"the batch has no {k!r} (keys: {sorted(local)}); expected {k} {s.dtype} {s.shape}")
        a = np.asarray(local[k])
        if a.shape != s.shape or a.dtype != s.dtype:
            raise ValueError(f"batch key {k!r} is {a.dtype} {a.shape}; expected {np.dtype(s.dtype)} {s.shape}")


def to_device(local: dict, mesh: Mesh, global_batch: int) -> dict[str, jax.Array]:
    """This process's rows of a batch (numpy) -> global jax.Arrays sharded over the data-parallel axes; host-only
    keys (`index`) stay behind. Works with any process count that divides the batch."""
    return sharding.global_batch_from_local({k: v for k, v in local.items() if k not in HOST_ONLY}, mesh, global_batch)


def text_inputs(batch: dict) -> dict:
    """The text conditioning of a batch: tokens or text_emb, and text_mask."""
    return {k: batch[k] for k in ("tokens", "text_emb", "text_mask") if k in batch}
