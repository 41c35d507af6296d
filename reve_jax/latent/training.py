"""Training the autoencoder once on a run's data, its cache and the reconstruction check."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from reve_jax import diffusion
from reve_jax.data import pipeline
from reve_jax.latent import ae_config, autoencoder
from reve_jax.progress import Progress

log = logging.getLogger("reve_jax")


def training_config(cfg):
    """`cfg` as the autoencoder's training reads it: TRAIN_SEED for its seeds (see `train`) and its own rendering,
    `latent.train_render`, where one is set."""
    cfg = cfg.copy_and_resolve_references()
    with cfg.unlocked():
        cfg.seed = cfg.data.seed = TRAIN_SEED
        if cfg.latent.get("train_render"):
            cfg.data.render = cfg.latent.train_render
    return cfg


def _data_key(cfg) -> dict:
    """What decides the autoencoder: the data it sees and its own settings (not the diffusion model's, nor the run's
    seeds: see `train`). `latent.train_render` counts as the rendering it names, so a fixed-rendering run that trains
    on the jittered images shares the jittered run's autoencoder."""
    cfg = training_config(cfg)
    keys = ("name", "path", "image_size", "num_samples", "max_objects", "min_objects", "render", "shapes")
    data = {k: cfg.data[k] for k in keys if k in cfg.data}
    if cfg.data.get("colors"):  # the palette, keyed only when restricted: the keys of full-palette caches stand
        data["colors"] = cfg.data.colors
    if cfg.data.get("heldout_frac", 0.0):  # the compositions its training never saw; keyed only when some are
        data["heldout"] = [cfg.data.heldout_frac, cfg.data.heldout_seed]
    data = {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}
    own = {k: v for k, v in cfg.latent.to_dict().items() if k not in ("path", "train_render")}
    return {"data": data, "latent": own}


def cache_key(cfg) -> str:
    return hashlib.sha256(json.dumps(_data_key(cfg), sort_keys=True).encode()).hexdigest()[:12]


def _batches(cfg, batch: int, start: int):
    it = pipeline.make_batch_iterator(cfg.data, cfg.text.max_len, batch, 0, 1, start * batch, text_cfg=cfg.text)
    for b in it:
        yield np.asarray(diffusion.to_unit(b["image"]))


TRAIN_SEED = 0


def train(
    cfg, partial: str | Path | None = None, save_every_s: float = 120.0, stop_at: int | None = None
) -> tuple[autoencoder.Autoencoder | None, dict]:
    """Train the autoencoder of `cfg.latent` on `cfg.data` (latent.train_steps steps of latent.train_batch images,
    AdamW with a cosine decay), then measure the latents' per-channel shift and scale. Returns (model, info).

    The autoencoder belongs to the dataset, not to a run: it is initialised and fed with TRAIN_SEED whatever the
    run's `seed` and `data.seed`, so every seed of a benchmark shares one (as Linum's runs share one VAE).

    With `partial` (a file path), the training state is written there every `save_every_s` seconds and at the end
    of the loop, and a training that finds one resumes from it: the step's batch and noise key depend on the step
    only, so a resumed training ends where an uninterrupted one does (at 64 px it takes hours of a shared 2-core
    VM, longer than a session may last). `stop_at` ends the loop at that step with the state saved and returns
    (None, info): a deliberate interruption, for tests. The caller deletes `partial` once the weights are saved."""
    lt = cfg.latent
    cfg = training_config(cfg)
    model = autoencoder.Autoencoder(ae_config(cfg), rngs=nnx.Rngs(cfg.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sched = optax.cosine_decay_schedule(lt.train_lr, lt.train_steps, alpha=0.05)
    opt = optax.adamw(sched, b1=0.9, b2=0.99, weight_decay=0.0)
    opt_state = opt.init(params)

    def loss_fn(p, x, key):
        m = nnx.merge(graphdef, p, rest)
        z = m.encode_raw(x)
        spread = jax.lax.stop_gradient(jnp.std(z)) + 1e-6
        recon = m.decode_raw(z + lt.train_noise * spread * jax.random.normal(key, z.shape))
        mse = jnp.mean((recon - x) ** 2)
        return mse + lt.l1_weight * jnp.mean(jnp.abs(recon - x)) + lt.latent_l2 * jnp.mean(z**2), mse

    @jax.jit
    def step(p, o, x, key):
        (loss, mse), g = jax.value_and_grad(loss_fn, has_aux=True)(p, x, key)
        updates, o = opt.update(g, o, p)
        return optax.apply_updates(p, updates), o, mse

    start, seconds_before, resumes, ae_key = 0, 0.0, 0, cache_key(cfg)
    if partial is not None and Path(partial).is_file():
        (params, opt_state), start, seconds_before, resumes = _load_partial(partial, (params, opt_state), ae_key)
        resumes += 1
        log.info("autoencoder: resumed from step %d of %d (%s)", start, lt.train_steps, partial)
    end = lt.train_steps if stop_at is None else min(stop_at, lt.train_steps)
    t0 = last_save = time.perf_counter()
    key = jax.random.key(cfg.seed)
    mse = float("nan")
    progress = Progress("autoencoder step", lt.train_steps, start=start)
    for i, x in zip(range(start, end), _batches(cfg, lt.train_batch, start), strict=False):
        params, opt_state, mse = step(params, opt_state, x, jax.random.fold_in(key, i))
        progress(i + 1, lambda mse=mse: f"reconstruction mse {float(mse):.5f}")
        if partial is not None and time.perf_counter() - last_save > save_every_s:
            seconds = seconds_before + time.perf_counter() - t0
            _save_partial(partial, (params, opt_state), i + 1, seconds, resumes, ae_key)
            last_save = time.perf_counter()
    seconds = seconds_before + time.perf_counter() - t0
    if partial is not None and end > start:
        _save_partial(partial, (params, opt_state), end, seconds, resumes, ae_key)
    if end < lt.train_steps:
        return None, {"steps_done": end, "train_s": seconds}
    model = nnx.merge(graphdef, params, rest)
    shift, scale = _latent_stats(model, cfg)
    model.shift[...], model.scale[...] = shift, scale
    info = {
        "steps": lt.train_steps,
        "batch": lt.train_batch,
        "train_s": seconds,
        "train_cpu_note": "wall-clock seconds of the training loop on the machine in `machine` (summed over its "
        "pieces when it was resumed: `resumes`)",
        "resumes": resumes,
        "machine": {"devices": [d.device_kind for d in jax.devices()], "jax": jax.__version__},
        "final_mse": float(mse),
        "train_flops": 3 * autoencoder.encoder_flops_per_image(ae_config(cfg), *_hw(cfg)) * 2 * lt.train_steps
        * lt.train_batch,
        "key": _data_key(cfg),
    }  # fmt: skip
    return model, info


def _save_partial(path, state, step: int, seconds: float, resumes: int, key: str) -> None:
    """The training state after `step` steps, written beside the final weights and never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    leaves = {f"leaf{j}": np.asarray(v) for j, v in enumerate(jax.tree.leaves(state))}
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, step=step, seconds=seconds, resumes=resumes, key=np.frombuffer(key.encode(), np.uint8), **leaves)
    tmp.replace(path)


def _load_partial(path, like, key: str):
    """(state, step, seconds, resumes) from `_save_partial`'s file, checked against the training it would resume."""
    with np.load(path) as z:
        if "key" not in z or bytes(z["key"]).decode() != key:
            raise ValueError(
                f"{path} is the partial training of another autoencoder (not of data and latent settings {key}): "
                "delete it to train this one from the start"
            )
        leaves, treedef = jax.tree.flatten(like)
        saved = [z[f"leaf{j}"] for j in range(len(leaves)) if f"leaf{j}" in z]
        if len(saved) != len(leaves) or any(a.shape != np.shape(b) for a, b in zip(saved, leaves, strict=True)):
            raise ValueError(f"{path}: its training state does not fit this autoencoder; delete it to start over")
        arrays = [jnp.asarray(a, dtype=jnp.asarray(b).dtype) for a, b in zip(saved, leaves, strict=True)]
        state = jax.tree.unflatten(treedef, arrays)
        return state, int(z["step"]), float(z["seconds"]), int(z["resumes"])


def _hw(cfg) -> tuple[int, int]:
    return cfg.data.image_size, cfg.data.image_size


def _latent_stats(model, cfg, n_batches: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of the raw latents over n_batches batches past the training data."""
    enc = jax.jit(model.encode_raw)
    zs = [np.asarray(enc(x)) for _, x in zip(range(n_batches), _batches(cfg, 64, 10**6), strict=False)]
    z = np.concatenate(zs).reshape(-1, cfg.latent.channels)
    return z.mean(0).astype(np.float32), (z.std(0) + 1e-6).astype(np.float32)


def reconstruct(model: autoencoder.Autoencoder, images: np.ndarray, batch: int = 128) -> np.ndarray:
    """decode(encode(images)) for images [n, H, W, 3] in [-1, 1], clipped to [-1, 1]."""
    fn = jax.jit(lambda x: jnp.clip(model.decode(model.encode(x)), -1, 1))
    return np.concatenate([np.asarray(fn(images[i : i + batch])) for i in range(0, len(images), batch)])


def check_reconstructions(cfg, model: autoencoder.Autoencoder, n: int = 256) -> dict:
    """Caption alignment (data/synthetic/alignment.py) of the autoencoder's reconstructions of `n` held-out images
    (the first evaluation split: unseen compositions where the data holds some out), beside the real images' own
    score, per attribute (`recon_<attribute>`), and the reconstruction PSNR."""
    from reve_jax.data.synthetic import alignment

    ds = pipeline.eval_dataset(cfg.data, pipeline.eval_splits(cfg.data)[0])
    idx = range(n)
    real = np.asarray(diffusion.to_unit(np.stack([ds[int(i)]["image"] for i in idx])))
    scenes = [ds.scene(int(i)) for i in idx]
    recon = reconstruct(model, real)
    mse = float(np.mean((recon - real) ** 2))
    scores = alignment.score(recon, scenes)
    return {
        "align_real": alignment.score(real, scenes)["align_overall"],
        "align_recon": scores["align_overall"],
        **{f"recon_{a}": scores[f"align_{a}"] for a in alignment.ATTRIBUTES},
        "psnr": float(10 * np.log10(4.0 / max(mse, 1e-12))),
        "n": n,
    }


def cache_path(cfg, cache_dir: str | Path) -> Path:
    """Where `cached` keeps the autoencoder for `cfg`'s data and latent settings (the file may not exist yet)."""
    return Path(cache_dir) / f"autoencoder_{cache_key(cfg)}.npz"


def cached(cfg, cache_dir: str | Path) -> tuple[Path, dict]:
    """The autoencoder for `cfg`'s data and latent settings from `cache_dir`, trained and checked there first when
    missing (training cost and reconstruction scores in its info). One trained on another rendering than the run's
    (`latent.train_render`) is checked again on the run's images: that check is info["check"], the stored one
    info["check_train"]. Returns (path, info)."""
    path = cache_path(cfg, cache_dir)
    trained_on = training_config(cfg)
    recheck = trained_on.data.render != cfg.data.render  # trained on other images than the run's: check on its own
    if path.is_file():
        if not recheck:
            return path, autoencoder.load(path)[1]["info"]
        model, meta = autoencoder.load(path)
        info = meta["info"]
    else:
        log.info("training the autoencoder (%d steps) into %s", cfg.latent.train_steps, path)
        partial = partial_path(path)
        model, info = train(cfg, partial=partial)
        info["check"] = check_reconstructions(trained_on, model)
        autoencoder.save(model, path, info)
        partial.unlink(missing_ok=True)
    if recheck:
        info = {**info, "check_train": info.get("check"), "check": check_reconstructions(cfg, model)}
    return path, info


def partial_path(path: Path) -> Path:
    """Where the training of the autoencoder to be saved at `path` keeps its state until it ends."""
    return path.with_name(path.stem + ".partial.npz")
