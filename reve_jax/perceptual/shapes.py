"""A feature space the project trains itself (and DINOv2's, given weights), for distances between image sets.

`FeatureNet` is a small CNN trained on the jittered synthetic dataset, with noise and blur augmentation, to
predict every scene attribute: the background color, and per grid cell the object's color, shape and size (or
empty). Every cell's window (the cell and a rim) is read by the same convolutional stages, pooled by mean and max,
so each cell gets an embedding whichever place in the cell its object sits; the nine cell embeddings (in grid
order, so position is kept) and a global one, concatenated, are the features (`FeatureNet.features`).
`per_object_accuracy` checks them where it matters: per object (not per cell, where most cells are empty), for
position, color, shape and size.

The weights are deterministic from the `FeatureSpec` (seed included) on one platform. The default spec's are
checked in under reve_jax/perceptual/shapes_weights/ (as float16, about 0.3 MB; a rebuild, `python -m
reve_jax.perceptual.build_shapes`, takes over an hour on 2 CPU cores); any other spec is trained and cached in
<cache_dir>/feature_net_<key>.npz. Images of any size are brought to 32 px first (average-pooled when the size is
a multiple of 32, resized otherwise): one feature space serves every benchmark size. The distances on these
features are KID (kid.py) and, kept for comparison, the Fréchet distance below.
"""

from __future__ import annotations

import dataclasses
import functools
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
from reve_jax.progress import Progress

log = logging.getLogger(__name__)

NET_SIZE = 32  # the feature net's input resolution
_VERSION = 3  # bump when FeatureNet or the training changes: old cache files are then ignored
WEIGHTS_DIR = Path(__file__).resolve().parent / "shapes_weights"
# Heads: background color; per cell, color (0 = empty, 1 + palette index), shape (0 = empty), size (0 = empty).
_N_COLORS, _N_SHAPES, _N_SIZES = len(synthetic.COLOR_NAMES), len(synthetic.SHAPES), len(synthetic.SIZES)
_CELLS = synthetic.GRID * synthetic.GRID
HEADS = {"background": (1, _N_COLORS), "color": (_CELLS, 1 + _N_COLORS), "shape": (_CELLS, 1 + _N_SHAPES)}
HEADS["size"] = (_CELLS, 1 + _N_SIZES)


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """Everything the feature net's weights depend on (its cache key).

    channels: conv widths per stage of the per-cell reader (two 3x3 convs each, the first strided from the second
    stage on); cell_dim,
    global_dim: widths of each cell's embedding and of the global one (features = 9 * cell_dim + global_dim);
    n_train images of the jittered dataset with `data_seed` and min_objects..max_objects objects, rendered at
    `sizes` (px) in proportions `size_weights` and brought to 32 px; `steps` of AdamW at `lr` (cosine) on batches
    of `batch`; augmentation: Gaussian pixel noise up to `noise` (0..255) on a share `p_noise` of the images,
    Gaussian blur up to `blur` px on `p_blur`; n_test held-out images (indices after the training ones)."""

    channels: tuple[int, ...] = (24, 48, 64)
    cell_dim: int = 48
    global_dim: int = 32
    n_train: int = 24576
    n_test: int = 1024
    min_objects: int = 1
    max_objects: int = 4
    sizes: tuple[int, ...] = (32, 16, 24, 64)
    size_weights: tuple[float, ...] = (0.55, 0.15, 0.15, 0.15)
    data_seed: int = 7919  # not the benchmark's data seed: the feature net never sees the evaluation images
    steps: int = 8000
    batch: int = 64
    lr: float = 3e-3
    noise: float = 30.0
    p_noise: float = 0.5
    blur: float = 1.0
    p_blur: float = 0.3
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps(dict(dataclasses.asdict(self), version=_VERSION), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


DEFAULT_SPEC = FeatureSpec()  # the metrics' network (KID, the Fréchet distance): checked in
# The network the loss terms read (REPA's target, the dino term's "features" target): trained apart from the metrics'
# (its own seed, images and a shorter schedule), so that no training objective optimises the space KID measures in.
# Checked in (`build_shapes --spec training`) so that every machine aligns to the same target; where the file is
# missing, trained on first use and cached (its training time is a one-time cost the speedup benchmark reports).
TRAINING_SPEC = FeatureSpec(seed=1, data_seed=104729, steps=4000)


_CROP = 16  # side in 32-px pixels of the window read around each cell: its 10.7 px and a rim of about 2.7 px


def _crop_origins() -> np.ndarray:
    """[9, 2]: each cell window's top-left corner in the input padded by _CROP // 2 on every side."""
    centers = (np.arange(synthetic.GRID) + 0.5) * NET_SIZE / synthetic.GRID
    starts = np.round(centers - _CROP / 2).astype(int) + _CROP // 2
    return np.array([(y, x) for y in starts for x in starts])


class FeatureNet(nnx.Module):
    """CNN on [B, 32, 32, 3] images in [-1, 1]. Each cell's window (the cell and a rim) is read by the same
    stages of two 3x3 GELU convs (the first strided from the second stage on), pooled by mean and max (a small
    object is found wherever it sits in its cell) into a per-cell embedding; a global embedding comes from the
    windows' pooled features and the image's mean color. Linear heads give the logits of HEADS."""

    def __init__(self, spec: FeatureSpec, rngs: nnx.Rngs):
        convs, norms, c_in = [], [], 3
        for i, c in enumerate(spec.channels):
            convs.append(nnx.Conv(c_in, c, (3, 3), strides=(2, 2) if i else (1, 1), padding="SAME", rngs=rngs))
            convs.append(nnx.Conv(c, c, (3, 3), padding="SAME", rngs=rngs))
            norms += [nnx.GroupNorm(c, num_groups=min(8, c), rngs=rngs) for _ in range(2)]
            c_in = c
        self.convs, self.norms = nnx.List(convs), nnx.List(norms)
        self.cell = nnx.Linear(2 * c_in, spec.cell_dim, rngs=rngs)
        self.glob = nnx.Linear(2 * c_in + 3, spec.global_dim, rngs=rngs)
        self.cell_head = nnx.Linear(spec.cell_dim, 3 + _N_COLORS + _N_SHAPES + _N_SIZES, rngs=rngs)
        self.bg_head = nnx.Linear(spec.global_dim, _N_COLORS, rngs=rngs)

    def embed(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[B, 32, 32, 3] -> (per-cell embeddings [B, 9, cell_dim], global embedding [B, global_dim])."""
        b, pad = x.shape[0], _CROP // 2
        padded = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="edge")
        crops = jnp.stack([padded[:, y : y + _CROP, z : z + _CROP] for y, z in _crop_origins()], 1)
        h = crops.reshape(b * _CELLS, _CROP, _CROP, 3)
        for conv, norm in zip(self.convs, self.norms, strict=True):
            h = jax.nn.gelu(norm(conv(h)))
        h = h.reshape(b, _CELLS, -1, h.shape[-1])
        pooled = jnp.concatenate([h.mean(2), h.max(2)], -1)  # [B, 9, 2C]
        glob = jnp.concatenate([pooled.mean(1), x.mean((1, 2))], -1)
        return jax.nn.gelu(self.cell(pooled)), jax.nn.gelu(self.glob(glob))

    def features(self, x: jax.Array) -> jax.Array:
        """[B, 32, 32, 3] in [-1, 1] -> f32 [B, 9 * cell_dim + global_dim]."""
        cells, glob = self.embed(x)
        return jnp.concatenate([cells.reshape(cells.shape[0], -1), glob], -1)

    def __call__(self, x: jax.Array) -> dict[str, jax.Array]:
        """Logits per head: name -> [B, cells, classes]."""
        cells, glob = self.embed(x)
        logits = self.cell_head(cells)
        color, shape, size = jnp.split(logits, [1 + _N_COLORS, 2 + _N_COLORS + _N_SHAPES], axis=-1)
        return {"background": self.bg_head(glob)[:, None], "color": color, "shape": shape, "size": size}


def scene_targets(scene: synthetic.Scene) -> dict[str, np.ndarray]:
    """Class targets of `scene` for the heads: name -> int32 [cells] ([1] for the background)."""
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
    x = diffusion.to_unit(jnp.asarray(images))
    s = x.shape[1]
    if s == NET_SIZE:
        return x
    if s % NET_SIZE == 0:
        f = s // NET_SIZE
        return x.reshape(x.shape[0], NET_SIZE, f, NET_SIZE, f, 3).mean(axis=(2, 4))
    return jax.image.resize(x, (x.shape[0], NET_SIZE, NET_SIZE, 3), method="linear", antialias=True)


# ------------------------------------------------------------------------------------------ data and training


def render_set(spec: FeatureSpec, start: int, n: int) -> tuple[np.ndarray, list[synthetic.Scene]]:
    """n images of the spec's dataset from index `start`, each rendered at a size drawn from spec.sizes (by the
    index) and brought to 32 px: (uint8 [n, 32, 32, 3], scenes)."""
    rng = np.random.default_rng([spec.data_seed, start, n])
    picks = rng.choice(len(spec.sizes), size=n, p=np.asarray(spec.size_weights) / sum(spec.size_weights))
    images = np.empty((n, NET_SIZE, NET_SIZE, 3), np.uint8)
    scenes = []
    for k, size in enumerate(spec.sizes):
        ds = synthetic.SyntheticShapes(size, 10**9, spec.data_seed, spec.max_objects, min_objects=spec.min_objects)
        idx = np.nonzero(picks == k)[0]
        for lo in range(0, len(idx), 512):
            chunk = idx[lo : lo + 512]
            raw = np.stack([ds[start + int(i)]["image"] for i in chunk])
            net = np.asarray(to_net_input(raw))
            images[chunk] = np.rint((net + 1.0) * 127.5).clip(0, 255).astype(np.uint8)
    ds = synthetic.SyntheticShapes(NET_SIZE, 10**9, spec.data_seed, spec.max_objects, min_objects=spec.min_objects)
    scenes = [ds.scene(start + i) for i in range(n)]
    return images, scenes


def _targets(scenes) -> dict[str, np.ndarray]:
    t = [scene_targets(s) for s in scenes]
    return {k: np.stack([x[k] for x in t]) for k in HEADS}


def gaussian_blur(x: jax.Array, sigma: jax.Array, radius: int = 3) -> jax.Array:
    """Blur images x [B, H, W, C] by per-image Gaussian widths sigma [B] (pixels; 0 = unchanged), separably."""
    t = jnp.arange(-radius, radius + 1, dtype=jnp.float32)
    w = jnp.exp(-0.5 * jnp.square(t[None] / jnp.maximum(sigma[:, None], 1e-3)))
    w = w / w.sum(1, keepdims=True)  # [B, K]
    for axis in (1, 2):
        pad = [(0, 0)] * 4
        pad[axis] = (radius, radius)
        xp = jnp.pad(x, pad, mode="edge")
        n = x.shape[axis]
        x = sum(w[:, k, None, None, None] * jax.lax.slice_in_dim(xp, k, k + n, axis=axis) for k in range(len(t)))
    return x


def augment(key: jax.Array, x: jax.Array, spec: FeatureSpec) -> jax.Array:
    """The training degradations on a batch in [-1, 1]: blur (share p_blur, width up to spec.blur px), then
    Gaussian noise (share p_noise, sigma up to spec.noise in 0..255)."""
    kb, kbs, kn, kns, ke = jax.random.split(key, 5)
    b = x.shape[0]
    blur = jnp.where(jax.random.uniform(kb, (b,)) < spec.p_blur, jax.random.uniform(kbs, (b,)) * spec.blur, 0.0)
    x = jnp.where((blur > 0.05)[:, None, None, None], gaussian_blur(x, blur), x)
    sigma = jnp.where(jax.random.uniform(kn, (b,)) < spec.p_noise, jax.random.uniform(kns, (b,)) * spec.noise, 0.0)
    x = x + (sigma / 127.5)[:, None, None, None] * jax.random.normal(ke, x.shape)
    return jnp.clip(x, -1.0, 1.0)


_LOSS_WEIGHTS = {"background": 1.0, "color": 1.0, "shape": 2.0, "size": 1.0}  # shape is the slowest to learn


def _loss(model: FeatureNet, x, targets):
    logits = model(x)
    losses = [
        w * optax.softmax_cross_entropy_with_integer_labels(logits[k], targets[k]).mean()
        for k, w in _LOSS_WEIGHTS.items()
    ]
    return sum(losses)


@functools.partial(jax.jit, static_argnums=0)
def _classes(graphdef, state, x):
    return {k: v.argmax(-1) for k, v in nnx.merge(graphdef, state)(to_net_input(x)).items()}


def predict(model: FeatureNet, images, batch: int = 512) -> dict[str, np.ndarray]:
    """Predicted classes of every head for images (any size, uint8 or [-1, 1]): name -> int [N, cells]."""
    graphdef, state = nnx.split(model)
    parts = [_classes(graphdef, state, images[i : i + batch]) for i in range(0, len(images), batch)]
    return {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in HEADS}


def per_object_accuracy(model: FeatureNet, images, scenes) -> dict[str, float]:
    """Held-out accuracy where it matters: per stated object, its cell read as occupied ("position") and its
    color, shape and size; the background per image; "empty": cells without an object read as empty."""
    pred = predict(model, images)
    hits = {k: [] for k in ("position", "color", "shape", "size")}
    empty = []
    for i, scene in enumerate(scenes):
        t = scene_targets(scene)
        for o in scene.objects:
            hits["position"].append(pred["color"][i, o.cell] != 0)
            for k in ("color", "shape", "size"):
                hits[k].append(pred[k][i, o.cell] == t[k][o.cell])
        stated = {o.cell for o in scene.objects}
        empty += [pred["color"][i, c] == 0 for c in range(_CELLS) if c not in stated]
    out = {k: float(np.mean(v)) for k, v in hits.items()}
    out["empty"] = float(np.mean(empty))
    out["background"] = float(np.mean(pred["background"][:, 0] == _targets(scenes)["background"][:, 0]))
    return out


def train_feature_net(spec: FeatureSpec) -> tuple[FeatureNet, dict]:
    """Trains a FeatureNet from scratch, deterministically for a given spec (on one platform). Returns (model,
    info): info has the held-out per-object accuracy on clean images ("test_accuracy"), under noise sigma 20
    ("test_accuracy_noise20") and blur 1 px ("test_accuracy_blur1"), and the training time."""
    t0 = time.perf_counter()
    images, scenes = render_set(spec, 0, spec.n_train)
    targets = _targets(scenes)
    model = FeatureNet(spec, nnx.Rngs(spec.seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, spec.lr, min(200, spec.steps // 10), spec.steps)
    opt = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=1e-4), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, t, key):
        x = augment(key, diffusion.to_unit(x), spec)
        loss, grads = nnx.value_and_grad(_loss)(model, x, t)
        opt.update(model, grads)
        return loss

    rng = np.random.default_rng(spec.seed)
    key = jax.random.key(spec.seed)
    loss = None
    progress = Progress("feature net step", spec.steps)
    for i in range(spec.steps):
        idx = rng.integers(0, spec.n_train, spec.batch)
        loss = step(model, opt, images[idx], {k: v[idx] for k, v in targets.items()}, jax.random.fold_in(key, i))
        progress(i + 1, lambda loss=loss: f"loss {float(loss):.4f}")
    spec_json = json.loads(json.dumps(dataclasses.asdict(spec)))  # as a saved file gives it back (lists)
    info = {"final_loss": float(loss), "train_s": time.perf_counter() - t0, "spec": spec_json}
    info.update(evaluate_feature_net(model, spec))
    return model, info


@functools.cache  # the report asks after every run: one lowering per spec
def train_flops(spec: FeatureSpec) -> float:
    """The FLOPs of training a FeatureNet of `spec`: 3x the forward pass of a 32 px image (XLA's cost analysis
    of the lowered forward; backward about twice the forward, the convention of the diffusion runs' counts) per
    image of every batch. Built abstractly: no weights, no training."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: FeatureNet(spec, nnx.Rngs(spec.seed))))
    x = jax.ShapeDtypeStruct((spec.batch, NET_SIZE, NET_SIZE, 3), jnp.float32)
    cost = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)).lower(state, x).cost_analysis()
    return 3.0 * float(cost["flops"]) * spec.steps


def evaluate_feature_net(model: FeatureNet, spec: FeatureSpec) -> dict:
    """Per-object accuracy on the spec's held-out images: clean, under noise sigma 20 (0..255), under a 1 px blur."""
    images, scenes = render_set(spec, spec.n_train, spec.n_test)
    x = diffusion.to_unit(jnp.asarray(images))
    noisy = jnp.clip(x + 20.0 / 127.5 * jax.random.normal(jax.random.key(1), x.shape), -1, 1)
    blurred = gaussian_blur(x, jnp.ones(len(x)))
    return {
        "test_accuracy": per_object_accuracy(model, images, scenes),
        "test_accuracy_noise20": per_object_accuracy(model, np.asarray(noisy), scenes),
        "test_accuracy_blur1": per_object_accuracy(model, np.asarray(blurred), scenes),
    }


# ------------------------------------------------------------------------------------------ weights files


def save_feature_net(model: FeatureNet, info: dict, path: Path, dtype=np.float32) -> Path:
    """Writes the parameters (as `dtype`) and `info` to an .npz at `path` atomically; returns the path."""
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    arrays = {"params/" + "/".join(map(str, k)): np.asarray(v.get_value(), dtype) for k, v in params}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays, info=np.array(json.dumps(info)))
    tmp.replace(path)  # a concurrent reader never sees half a file
    return path


def load_feature_net(spec: FeatureSpec, path: Path) -> tuple[FeatureNet, dict]:
    """A FeatureNet of `spec` with the weights of `path` (float32 whatever their stored dtype), and its info.
    The model is built abstractly and filled from the file: no initializer runs (or compiles)."""
    abstract = nnx.eval_shape(lambda: FeatureNet(spec, nnx.Rngs(spec.seed)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    with np.load(path) as f:
        info = json.loads(str(f["info"]))
        arrays = {k: jnp.asarray(f["params/" + "/".join(map(str, k))], jnp.float32) for k, _ in params.flat_state()}
    return nnx.merge(graphdef, nnx.State.from_flat_path(arrays)), info


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "reve_jax"


def get_feature_net(spec: FeatureSpec = DEFAULT_SPEC, cache_dir: str | Path | None = None):
    """The feature net of `spec`: the checked-in weights (perceptual/shapes_weights/feature_net_<key>.npz), else
    <cache_dir>/feature_net_<key>.npz, else trained and saved there. cache_dir defaults to ~/.cache/reve_jax.
    Returns (model, info)."""
    name = f"feature_net_{spec.key()}.npz"
    for path in (WEIGHTS_DIR / name, Path(cache_dir or default_cache_dir()) / name):
        if path.exists():
            return load_feature_net(spec, path)
    log.info("training the evaluation feature net (%s); cached at %s", spec, path)
    model, info = train_feature_net(spec)
    save_feature_net(model, info, path)
    log.info("feature net: held-out per-object accuracy %s in %.1fs", info["test_accuracy"], info["train_s"])
    return model, info


def make_feature_fn(model: FeatureNet, batch: int = 512):
    """Jitted images (uint8 or float [-1, 1], [N,S,S,3]) -> float64 [N, D] features, `batch` images per call."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, x: nnx.merge(graphdef, st).features(to_net_input(x)))

    def features(images):
        images = np.asarray(images)
        return np.concatenate(
            [np.asarray(fn(state, images[i : i + batch]), np.float64) for i in range(0, len(images), batch)]
        )

    return features
