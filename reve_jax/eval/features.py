"""A feature space the project trains itself, and Fréchet distances in it (and in DINOv2's, given weights).

`FeatureNet` is a small CNN trained on the synthetic dataset to predict every scene attribute (background color,
and per grid cell: object color or empty, shape or empty, size or empty). Its penultimate activations are the
features; the Fréchet distance between Gaussians fitted to the features of generated and of real images is the
"FD-shapes" metric, the analogue of FID with a network that knows this data. The network is rebuilt
deterministically from its `FeatureSpec` (seed included) in well under a minute on a CPU and cached in a small
.npz keyed by the spec, so every run of the benchmark scores images with the same weights.

Images of any size that is a multiple of 32 are average-pooled to 32 px first (other sizes are resized
bilinearly), so one feature space serves every benchmark size.
"""

from __future__ import annotations

import dataclasses
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
from reve_jax.data import synthetic

log = logging.getLogger(__name__)

NET_SIZE = 32  # the feature net's input resolution
_VERSION = 1  # bump when FeatureNet or the training changes: old cache files are then ignored
# Heads: background color; per cell, color (0 = empty, 1 + palette index), shape (0 = empty), size (0 = empty).
_N_COLORS, _N_SHAPES, _N_SIZES = len(synthetic.COLOR_NAMES), len(synthetic.SHAPES), len(synthetic.SIZES)
_CELLS = synthetic.GRID * synthetic.GRID
HEADS = {"background": (1, _N_COLORS), "color": (_CELLS, 1 + _N_COLORS), "shape": (_CELLS, 1 + _N_SHAPES)}
HEADS["size"] = (_CELLS, 1 + _N_SIZES)


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """Everything the feature net's weights depend on (its cache key). channels: conv widths, each conv halves
    the resolution; feat_dim: width of the penultimate layer (the features); n_train images of the dataset with
    `data_seed` and up to `max_objects` objects; `steps` of AdamW at `lr` on batches of `batch`."""

    channels: tuple[int, ...] = (16, 32, 64)
    feat_dim: int = 64
    n_train: int = 6144
    n_test: int = 512
    max_objects: int = 3
    data_seed: int = 7919  # not the benchmark's data seed: the feature net never sees the evaluation images
    steps: int = 600
    batch: int = 128
    lr: float = 3e-3
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps(dict(dataclasses.asdict(self), version=_VERSION), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


DEFAULT_SPEC = FeatureSpec()


class FeatureNet(nnx.Module):
    """CNN on [B, 32, 32, 3] images in [-1, 1]: stride-2 3x3 convs with GELU, then a dense layer (the features),
    then linear heads (logits for HEADS)."""

    def __init__(self, spec: FeatureSpec, rngs: nnx.Rngs):
        chans = (3, *spec.channels)
        self.convs = nnx.List(
            [
                nnx.Conv(a, b, (3, 3), strides=(2, 2), padding="SAME", rngs=rngs)
                for a, b in zip(chans[:-1], chans[1:], strict=True)
            ]
        )
        side = NET_SIZE // 2 ** len(spec.channels)
        self.dense = nnx.Linear(side * side * chans[-1], spec.feat_dim, rngs=rngs)
        n_logits = sum(n * k for n, k in HEADS.values())
        self.head = nnx.Linear(spec.feat_dim, n_logits, rngs=rngs)

    def features(self, x: jax.Array) -> jax.Array:
        """[B, 32, 32, 3] in [-1, 1] -> f32 [B, feat_dim]."""
        for conv in self.convs:
            x = jax.nn.gelu(conv(x))
        return jax.nn.gelu(self.dense(x.reshape(x.shape[0], -1)))

    def __call__(self, x: jax.Array) -> dict[str, jax.Array]:
        """Logits per head: name -> [B, cells, classes]."""
        logits = self.head(self.features(x))
        out, start = {}, 0
        for name, (n, k) in HEADS.items():
            out[name] = logits[:, start : start + n * k].reshape(-1, n, k)
            start += n * k
        return out


def scene_targets(scene: synthetic.Scene) -> dict[str, np.ndarray]:
    """Class targets of `scene` for the heads: name -> int32 [cells]."""
    color = np.zeros(_CELLS, np.int32)
    shape = np.zeros(_CELLS, np.int32)
    size = np.zeros(_CELLS, np.int32)
    for o in scene.objects:
        color[o.cell] = 1 + synthetic.COLOR_NAMES.index(o.color)
        shape[o.cell] = 1 + synthetic.SHAPES.index(o.shape)
        size[o.cell] = 1 + synthetic.SIZES.index(o.size)
    bg = np.array([synthetic.COLOR_NAMES.index(scene.background)], np.int32)
    return {"background": bg, "color": color, "shape": shape, "size": size}


def to_net_input(images) -> jax.Array:
    """uint8 [N,S,S,3] or float in [-1, 1] -> f32 [N, 32, 32, 3] in [-1, 1] (average-pooled or resized)."""
    x = jnp.asarray(images)
    x = diffusion.to_unit(x)
    s = x.shape[1]
    if s == NET_SIZE:
        return x
    if s % NET_SIZE == 0:
        f = s // NET_SIZE
        return x.reshape(x.shape[0], NET_SIZE, f, NET_SIZE, f, 3).mean(axis=(2, 4))
    return jax.image.resize(x, (x.shape[0], NET_SIZE, NET_SIZE, 3), method="linear", antialias=True)


def _dataset(spec: FeatureSpec, start: int, n: int):
    ds = synthetic.SyntheticShapes(NET_SIZE, 10**9, spec.data_seed, spec.max_objects)
    images = np.stack([ds[i]["image"] for i in range(start, start + n)])
    targets = [scene_targets(ds.scene(i)) for i in range(start, start + n)]
    return images, {k: np.stack([t[k] for t in targets]) for k in HEADS}


def _loss(model: FeatureNet, x, targets):
    logits = model(x)
    losses = [optax.softmax_cross_entropy_with_integer_labels(logits[k], targets[k]).mean() for k in HEADS]
    return sum(losses)


def head_accuracy(model: FeatureNet, images, targets) -> dict[str, float]:
    """Per-head accuracy of `model` on uint8 `images` with `targets` (from scene_targets): name -> fraction."""
    logits = jax.jit(lambda m, x: m(x))(model, to_net_input(images))
    return {k: float(np.mean(np.asarray(logits[k]).argmax(-1) == targets[k])) for k in HEADS}


def train_feature_net(spec: FeatureSpec) -> tuple[FeatureNet, dict]:
    """Trains a FeatureNet from scratch, deterministically for a given spec. Returns (model, info) where info has
    the held-out per-head accuracy and the training time."""
    t0 = time.perf_counter()
    images, targets = _dataset(spec, 0, spec.n_train)
    x_all = to_net_input(images)
    model = FeatureNet(spec, nnx.Rngs(spec.seed))
    schedule = optax.cosine_decay_schedule(spec.lr, spec.steps)
    opt = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=1e-4), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, t):
        loss, grads = nnx.value_and_grad(_loss)(model, x, t)
        opt.update(model, grads)
        return loss

    rng = np.random.default_rng(spec.seed)
    loss = None
    for _ in range(spec.steps):
        idx = rng.integers(0, spec.n_train, spec.batch)
        loss = step(model, opt, x_all[idx], {k: v[idx] for k, v in targets.items()})
    test_images, test_targets = _dataset(spec, spec.n_train, spec.n_test)
    info = {"test_accuracy": head_accuracy(model, test_images, test_targets), "final_loss": float(loss)}
    info["train_s"] = time.perf_counter() - t0
    return model, info


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(int(p) if p.isdigit() else p, {})
        node[int(leaf) if leaf.isdigit() else leaf] = v
    return tree


def save_feature_net(model: FeatureNet, info: dict, path: Path) -> Path:
    params = _flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    params = {f"params/{k}": v for k, v in params.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **params, info=np.array(json.dumps(info)))
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return path


def load_feature_net(spec: FeatureSpec, path: Path) -> tuple[FeatureNet, dict]:
    with np.load(path) as f:
        flat = {k[len("params/") :]: f[k] for k in f.files if k.startswith("params/")}
        info = json.loads(str(f["info"]))
    model = FeatureNet(spec, nnx.Rngs(spec.seed))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, _unflatten(flat))
    nnx.update(model, state)
    return model, info


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "reve_jax"


def get_feature_net(spec: FeatureSpec = DEFAULT_SPEC, cache_dir: str | Path | None = None):
    """The feature net of `spec`: loaded from `<cache_dir>/feature_net_<key>.npz`, or trained and saved there.
    cache_dir defaults to ~/.cache/reve_jax. Returns (model, info)."""
    path = Path(cache_dir or default_cache_dir()) / f"feature_net_{spec.key()}.npz"
    if path.exists():
        return load_feature_net(spec, path)
    log.info("training the evaluation feature net (%s); cached at %s", spec, path)
    model, info = train_feature_net(spec)
    save_feature_net(model, info, path)
    log.info("feature net: held-out accuracy %s in %.1fs", info["test_accuracy"], info["train_s"])
    return model, info


def make_feature_fn(model: FeatureNet):
    """Jitted images (uint8 or float [-1, 1], [N,S,S,3]) -> f32 [N, feat_dim]."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, x: nnx.merge(graphdef, st).features(to_net_input(x)))
    return lambda images: np.asarray(fn(state, images), np.float64)


# ------------------------------------------------------------------------------------------ Fréchet distance


def gaussian_stats(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean float64 [D] and covariance float64 [D, D] (unbiased) of features [N, D], N >= 2."""
    f = np.asarray(features, np.float64)
    if f.ndim != 2 or f.shape[0] < 2:
        raise ValueError(f"need features [N >= 2, D], got shape {f.shape}")
    return f.mean(0), np.cov(f, rowvar=False).reshape(f.shape[1], f.shape[1])


def _psd_sqrt(a: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh((a + a.T) / 2)
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2), in float64:
    |mu1 - mu2|^2 + tr(s1) + tr(s2) - 2 tr((s1^1/2 s2 s1^1/2)^1/2). The symmetric form keeps every matrix
    positive semi-definite, so the square roots are exact eigendecompositions (no complex parts to drop).
    Returns a float >= 0."""
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    s1, s2 = np.asarray(sigma1, np.float64), np.asarray(sigma2, np.float64)
    r1 = _psd_sqrt(s1)
    cross = np.sqrt(np.clip(np.linalg.eigvalsh(r1 @ s2 @ r1), 0.0, None)).sum()
    fd = float(np.square(mu1 - mu2).sum() + np.trace(s1) + np.trace(s2) - 2.0 * cross)
    return max(fd, 0.0)  # rounding (sqrt of ~0 eigenvalues of rank-deficient covariances) can dip below 0


def feature_fd(feats_a: np.ndarray, feats_b: np.ndarray) -> float:
    """Fréchet distance between the Gaussians fitted to two feature sets [N, D] and [M, D]."""
    return frechet_distance(*gaussian_stats(feats_a), *gaussian_stats(feats_b))


# ------------------------------------------------------------------------------------------ DINOv2


def make_dinov2_fn(path: str | Path, pool: str = "cls", size: int = 224, batch: int = 64):
    """Features of a converted DINOv2 file (reve_jax.perceptual.load_dinov2): returns fn(images uint8 or float
    [-1, 1], [N,S,S,3]) -> float64 [N, D], images resized to `size` (antialiased bilinear), `pool` = "cls" (the
    class token) or "mean" (mean patch token)."""
    from reve_jax.perceptual import load_dinov2, resize

    if pool not in ("cls", "mean"):
        raise ValueError(f"pool={pool!r}: choose 'cls' or 'mean'")
    graphdef, state = nnx.split(load_dinov2(path))

    @jax.jit
    def fn(st, x):
        x = diffusion.to_unit(x)
        feats = nnx.merge(graphdef, st)(resize(x, size, size))
        return feats.cls if pool == "cls" else feats.patch.mean(axis=1)

    def features(images):
        images = np.asarray(images)
        return np.concatenate(
            [np.asarray(fn(state, images[i : i + batch]), np.float64) for i in range(0, len(images), batch)]
        )

    return features
