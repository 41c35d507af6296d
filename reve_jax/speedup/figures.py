"""The figures of docs/evaluation.md, each from one command (markdown tables on stdout):

    python -m reve_jax.speedup.figures reader [--sizes 16,24,32,64,128] [--n 512] [--render jitter]
    python -m reve_jax.speedup.figures controls [--sizes 32] [--n 512] [--max-objects 3]
    python -m reve_jax.speedup.figures features [--n 1024]
    python -m reve_jax.speedup.figures kid [--sizes 32] [--n 512] [--max-objects 3]

Every image set is drawn from the held-out end of the dataset (data.seed 0, the last n indices), as the Evaluator
draws it; degradations are seeded, so every run prints the same numbers. The dataset options (--max-objects,
--render, --shapes, --colors) apply to the reader, controls and kid tables alike (a benchmark size's data:
`--max-objects 1 --render fixed` for the `cpu` size, with `--colors red,green,blue,white --shapes
circle,square,triangle` for `cpu30`).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from scipy.ndimage import gaussian_filter

from reve_jax.data import synthetic
from reve_jax.data.synthetic import alignment, controls
from reve_jax.metrics import bootstrap, frechet, kid
from reve_jax.perceptual import shapes


def _noise(x, sigma):
    return np.clip(x + np.random.default_rng(0).normal(0, sigma, x.shape), 0, 255).astype(np.uint8)


def _blur(x, sigma):
    return np.stack([gaussian_filter(im.astype(np.float32), (sigma, sigma, 0)) for im in x]).round().astype(np.uint8)


def _tint(x, t):
    return np.clip(x.astype(int) + t, 0, 255).astype(np.uint8)


# name -> (label, fn(images, size)); blur widths are in pixels of a 32 px image (scaled with the size), shifts in
# pixels of the image itself.
DEGRADATIONS = {
    "clean": ("clean", lambda x, s: x),
    "noise10": ("noise sigma 10", lambda x, s: _noise(x, 10)),
    "noise20": ("noise sigma 20", lambda x, s: _noise(x, 20)),
    "noise30": ("noise sigma 30", lambda x, s: _noise(x, 30)),
    "blur0.5": ("blur 0.5 px @32", lambda x, s: _blur(x, 0.5 * s / 32)),
    "blur1": ("blur 1 px @32", lambda x, s: _blur(x, 1.0 * s / 32)),
    "shift1": ("shift 1 px", lambda x, s: np.roll(x, (1, 1), axis=(1, 2))),
    "shift2": ("shift 2 px", lambda x, s: np.roll(x, (2, 2), axis=(1, 2))),
    "tint35": ("tint +35", lambda x, s: _tint(x, 35)),
}


def heldout(size: int, n: int, max_objects: int = 3, render: str = "jitter", *, shapes=(), colors=()):
    """(dataset, held-out index [n], images uint8 [n, S, S, 3], scenes) as the Evaluator draws them; shapes and
    colors restrict the vocabulary as data.shapes / data.colors do (() = all)."""
    ds = synthetic.SyntheticShapes(size, 1_000_000, 0, max_objects, render=render, shapes=shapes, colors=colors)
    index = np.arange(len(ds) - n, len(ds))
    return ds, index, np.stack([ds[int(i)]["image"] for i in index]), [ds.scene(int(i)) for i in index]


def _row(label, r, extra=""):
    cells = " | ".join(f"{r[f'align_{a}']:.3f}" for a in (*alignment.ATTRIBUTES, "overall", "exact"))
    return f"| {label} | {cells} |{extra}"


_HEAD = "| background | count | position | color | shape | size | overall | exact |"


def reader_table(sizes, n, names=tuple(DEGRADATIONS), **data) -> str:
    """The reader's scores per size and degradation, with its speed on the clean images; `data`: heldout's
    dataset options."""
    out = [f"| size, images | {_HEAD[2:]} ms/image |", "|---" * 10 + "|"]
    for size in sizes:
        _, _, images, scenes = heldout(size, n, **data)
        for name in names:
            label, fn = DEGRADATIONS[name]
            x = fn(images, size)
            t0 = time.process_time()
            r = alignment.score(x, scenes)
            ms = 1000 * (time.process_time() - t0) / n
            out.append(_row(f"{size} px, {label}", r, f" {ms:.1f} |"))
    return "\n".join(out)


def controls_table(sizes, n, **data) -> str:
    """Alignment of the controls (controls.py) with 95% bootstrap intervals of align_overall; `data`: heldout's
    dataset options."""
    out = [f"| size, control | {_HEAD[2:]} overall 95% |", "|---" * 10 + "|"]
    w = bootstrap.counts(n, 1000, seed=0)
    for size in sizes:
        ds, index, images, scenes = heldout(size, n, **data)
        for name, x in {"held-out real": images, **controls.control_images(ds, index, seed=0)}.items():
            checks = alignment.check_batch(alignment.read_batch(x), scenes)
            lo, hi = bootstrap.interval(bootstrap.alignment_samples(checks, w)["align_overall"])
            out.append(_row(f"{size} px, {name}", alignment.summarize(checks), f" [{lo:.3f}, {hi:.3f}] |"))
    return "\n".join(out)


def features_table(n: int) -> str:
    """The checked-in feature net's per-object accuracy on held-out images (past its own test set), clean and
    degraded, and at each size it is trained for."""
    model, info = shapes.get_feature_net(shapes.DEFAULT_SPEC)
    spec = shapes.DEFAULT_SPEC
    start = spec.n_train + spec.n_test
    keys = ("position", "color", "shape", "size", "empty", "background")
    out = ["| images | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    images, scenes = shapes.render_set(spec, start, n)
    for label, x in (("mixed sizes, clean", images), ("mixed sizes, noise 20", _noise(images, 20)),
                     ("mixed sizes, blur 1 px", _blur(images, 1.0))):  # fmt: skip
        acc = shapes.per_object_accuracy(model, x, scenes)
        out.append(f"| {label} | " + " | ".join(f"{acc[k]:.3f}" for k in keys) + " |")
    for size in (16, 32, 128):
        _, _, x, sc = heldout(size, n)
        acc = shapes.per_object_accuracy(model, x, sc)
        out.append(f"| {size} px held-out | " + " | ".join(f"{acc[k]:.3f}" for k in keys) + " |")
    out.append(f"\nTraining: {info.get('train_s', float('nan')):.0f} s; stored accuracy {info['test_accuracy']}")
    return "\n".join(out)


def kid_table(sizes, n, **data) -> str:
    """KID (joint and image-only) of the controls and of wrong images against the held-out real set, with the
    real-vs-real floor and 95% bootstrap intervals (x 1000 for reading); `data`: heldout's dataset options."""
    model, _ = shapes.get_feature_net(shapes.DEFAULT_SPEC)
    fn = shapes.make_feature_fn(model)
    w = bootstrap.counts(n, 500, seed=0)
    out = ["| size, set | KID x1e3 (joint) | 95% | KID x1e3 (image) | 95% | FD |", "|---" * 6 + "|"]
    for size in sizes:
        ds, index, images, scenes = heldout(size, n, **data)
        codes = kid.scene_codes(scenes)
        f_real = fn(images)
        spaces = {"joint": kid.Space.fit(f_real, codes), "image": kid.Space.fit(f_real)}
        ref = {k: sp.embed(f_real, codes if k == "joint" else None) for k, sp in spaces.items()}
        sets = controls.control_images(ds, index, seed=0)
        rng = np.random.default_rng(0)
        wrong = [wrong_cells(s, rng) for s in scenes]
        circles = [all_circles(s) for s in scenes]
        sets["wrong cells"] = np.stack([ds.draw(s, (0, int(i), 7)) for s, i in zip(wrong, index, strict=True)])
        sets["all circles"] = np.stack([ds.draw(s, (0, int(i), 8)) for s, i in zip(circles, index, strict=True)])
        sets["noise 20"] = _noise(images, 20)
        for name, x in sets.items():
            f = fn(x)
            row = f"| {size} px, {'real (floor)' if name == 'real' else name} |"
            for k, sp in spaces.items():
                e = sp.embed(f, codes if k == "joint" else None)
                lo, hi = bootstrap.interval(kid.kid_resampled(e, ref[k], w))
                row += f" {1e3 * kid.kid(e, ref[k]):.2f} | [{1e3 * lo:.2f}, {1e3 * hi:.2f}] |"
            out.append(row + f" {frechet.feature_fd(f, f_real):.2f} |")
    return "\n".join(out)


def wrong_cells(scene, rng):
    """`scene` with every object moved to a cell no object of it had (drawn by `rng`)."""
    used = {o.cell for o in scene.objects}
    moved = []
    for o in scene.objects:
        cell = int(rng.choice([c for c in range(9) if c not in used]))
        used.add(cell)
        moved.append(dataclasses.replace(o, cell=cell))
    return dataclasses.replace(scene, objects=tuple(moved))


def all_circles(scene):
    """`scene` with every shape a circle."""
    return dataclasses.replace(scene, objects=tuple(dataclasses.replace(o, shape="circle") for o in scene.objects))


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("figure", choices=("reader", "controls", "features", "kid"))
    p.add_argument("--sizes", default=None, help="comma-separated image sizes")
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--max-objects", type=int, default=3)
    p.add_argument("--render", default="jitter", choices=synthetic.RENDERS)
    p.add_argument("--shapes", default="", help="comma-separated shapes (data.shapes; default: all)")
    p.add_argument("--colors", default="", help="comma-separated palette colors (data.colors; default: all)")
    a = p.parse_args(argv)
    data = dict(max_objects=a.max_objects, render=a.render, shapes=_names(a.shapes), colors=_names(a.colors))
    sizes = [int(s) for s in (a.sizes or ("16,24,32,64,128" if a.figure == "reader" else "32")).split(",")]
    if a.figure == "reader":
        print(reader_table(sizes, a.n, **data))
    elif a.figure == "controls":
        print(controls_table(sizes, a.n, **data))
    elif a.figure == "features":
        print(features_table(a.n))
    else:
        print(kid_table(sizes, a.n, **data))


if __name__ == "__main__":
    main()
