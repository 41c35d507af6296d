"""Caption alignment on the procedural dataset, GenEval-style: every attribute a caption states is checked
against the pixels of the image generated for it, and the fraction of checks that pass is reported.

The reader knows only the image and the dataset's geometry (the 3x3 grid, `object_coverage`), never the scene:

- background: the palette color most pixels are nearest to, provided at least `min_background` of the pixels lie
  within `tol` of it: noise around a color is not a solid background of that color (otherwise a model that only
  learned each caption's mean color would pass the background check);
- per cell: each pixel is explained as a blend `bg + a * (c - bg)` of the background and one palette color c (the
  way `render_scene` anti-aliases); a pixel off every such segment by more than `tol` counts for nothing. The cell's
  object color is the one with the largest summed coverage `a`; its shape and size are those of the rendered
  template (5 shapes x 2 sizes, shifted by up to `shift` pixels) with the highest soft IoU against that coverage.
  A cell holds an object when that coverage is at least half the smallest template's area, the best IoU is at
  least `min_iou`, and few of its pixels are clutter (neither background nor that blend): noise and smears hold
  none, so half-trained samples full of colored noise earn no count or position by luck.

Checks per image: background (1), count (1: occupied cells == stated objects), and per stated object position
(its cell holds an object), color, shape and size. As in GenEval, the attributes of an object that is not found
count as wrong. `score` returns the fraction correct per attribute, their mean ("overall") and the fraction of
images with every check right ("exact"). Pure numpy: about a millisecond per 32 px image.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from reve_jax.data import synthetic

ATTRIBUTES = ("background", "count", "position", "color", "shape", "size")
# A reader guessing uniformly: 8 backgrounds, 7 object colors (never the background's), 5 shapes, 2 sizes; a cell
# is occupied or not; 1..max_objects objects (3 by default).
CHANCE = {"background": 1 / 8, "count": 1 / 3, "position": 1 / 2, "color": 1 / 7, "shape": 1 / 5, "size": 1 / 2}
PALETTE = np.array([synthetic.COLORS[c] for c in synthetic.COLOR_NAMES], np.float32)  # [8, 3] in 0..255
TEMPLATES = tuple((shape, size) for shape in synthetic.SHAPES for size in synthetic.SIZES)


@dataclasses.dataclass(frozen=True)
class Reader:
    """Thresholds of the pixel reader. tol: distance in 0..255 RGB units a pixel may lie off the bg -> color
    segment; min_iou: least soft IoU with a template for a cell to hold an object; shift: template offsets tried,
    in units of image_size / 32 pixels (so the same tolerance at every resolution); max_clutter: largest share of
    a cell's pixels explained neither as background nor as a blend of it with the object's color (noise and
    smears of many colors) for the cell to hold an object; min_background: least share of the image's pixels within
    tol of the background color for the image to have a background at all (objects cover at most a quarter)."""

    tol: float = 40.0
    min_iou: float = 0.35
    shift: int = 1
    max_clutter: float = 0.15
    min_background: float = 0.5


@dataclasses.dataclass(frozen=True)
class CellReading:
    """What the reader sees in one cell: occupied, and if so the color, shape and size names and the IoU."""

    occupied: bool
    color: str = ""
    shape: str = ""
    size: str = ""
    iou: float = 0.0


def to_rgb255(images: np.ndarray) -> np.ndarray:
    """uint8 images in 0..255, or float images in [-1, 1] (the model's range) -> float32 in 0..255, same shape."""
    images = np.asarray(images)
    if images.dtype == np.uint8:
        return images.astype(np.float32)
    return np.clip((images.astype(np.float32) + 1.0) * 127.5, 0.0, 255.0)


def _cell_bounds(image_size: int) -> list[tuple[int, int, int, int]]:
    """(y0, y1, x0, x1) per cell, row-major: pixel i belongs to the cell row its center falls in."""
    edges = [int(np.ceil(k * image_size / synthetic.GRID - 0.5)) for k in range(synthetic.GRID + 1)]
    return [
        (edges[r], edges[r + 1], edges[c], edges[c + 1]) for r in range(synthetic.GRID) for c in range(synthetic.GRID)
    ]


@functools.lru_cache(maxsize=8)
def _templates(image_size: int) -> tuple[np.ndarray, ...]:
    """Per cell: the coverage of every (shape, size) template over the cell's window, float32 [10, h, w]."""
    out = []
    for cell, (y0, y1, x0, x1) in enumerate(_cell_bounds(image_size)):
        maps = [
            synthetic.object_coverage(synthetic.SceneObject(shape, "red", size, cell), image_size)[y0:y1, x0:x1]
            for shape, size in TEMPLATES
        ]
        out.append(np.stack(maps))
    return tuple(out)


def background(image: np.ndarray) -> tuple[int, np.ndarray]:
    """The background of `image` (float [H, W, 3] in 0..255): the palette index most pixels are nearest to, and
    the median RGB of those pixels (float32 [3]; a generated background may be tinted off the palette)."""
    pixels = image.reshape(-1, 3)
    nearest = np.square(pixels[:, None] - PALETTE[None]).sum(-1).argmin(1)
    bg = int(np.bincount(nearest, minlength=len(PALETTE)).argmax())
    return bg, np.median(pixels[nearest == bg], axis=0).astype(np.float32)


def color_coverage(image: np.ndarray, bg: int, bg_rgb: np.ndarray, tol: float) -> np.ndarray:
    """Coverage of each palette color over `image` (float [H, W, 3] in 0..255) seen as blends with the measured
    background color `bg_rgb` (palette index `bg`): float32 [8, H, W]; each pixel goes to the one color whose
    segment bg_rgb -> color it lies nearest (within `tol`), with its blend fraction in [0, 1]; the background's
    own map is zero."""
    p = image - bg_rgb  # [H, W, 3]
    d = PALETTE - bg_rgb  # [8, 3]
    norm2 = np.maximum(np.square(d).sum(-1), 1e-6)
    a = np.clip(np.einsum("hwc,kc->khw", p, d) / norm2[:, None, None], 0.0, 1.0)
    resid = np.linalg.norm(p[None] - a[..., None] * d[:, None, None, :], axis=-1)  # [8, H, W]
    resid[bg] = np.inf
    best = resid.argmin(0)
    ok = resid.min(0) <= tol
    onehot = (np.arange(len(PALETTE))[:, None, None] == best[None]) & ok[None]
    return np.where(onehot, a, 0.0).astype(np.float32)


def _shifted(cov: np.ndarray, y0: int, y1: int, x0: int, x1: int, s: int) -> np.ndarray:
    """The window [y0:y1, x0:x1] of `cov` [H, W] under every offset in {-s, 0, s}^2 (zeros outside): [k, h, w]."""
    padded = np.pad(cov, s)
    offs = (-s, 0, s) if s else (0,)
    return np.stack([padded[y0 + s + dy : y1 + s + dy, x0 + s + dx : x1 + s + dx] for dy in offs for dx in offs])


def read_image(image: np.ndarray, reader: Reader = Reader()) -> tuple[str, list[CellReading]]:
    """Reads one image (uint8 or float [-1, 1], [S, S, 3]); returns (background color name, or "" when no color
    covers `min_background` of the image, and 9 CellReadings)."""
    img = to_rgb255(image)
    size = img.shape[0]
    if img.shape != (size, size, 3):
        raise ValueError(f"expected a square RGB image [S, S, 3], got shape {img.shape}")
    bg, bg_rgb = background(img)
    cov = color_coverage(img, bg, bg_rgb, reader.tol)
    near_bg = np.linalg.norm(img - bg_rgb, axis=-1) <= reader.tol
    solid = np.mean(np.linalg.norm(img - PALETTE[bg], axis=-1) <= reader.tol) >= reader.min_background
    templates = _templates(size)
    min_area = min(t.sum(axis=(1, 2)).min() for t in templates)
    s = reader.shift * max(1, size // 32)
    cells = []
    for cell, (y0, y1, x0, x1) in enumerate(_cell_bounds(size)):
        mass = cov[:, y0:y1, x0:x1].sum(axis=(1, 2))
        k = int(mass.argmax())
        clutter = 1.0 - float(np.mean(near_bg[y0:y1, x0:x1] | (cov[k, y0:y1, x0:x1] > 0)))
        if mass[k] < 0.5 * min_area or clutter > reader.max_clutter:
            cells.append(CellReading(False))
            continue
        obs = _shifted(cov[k], y0, y1, x0, x1, s)[:, None]  # [offsets, 1, h, w]
        tpl = templates[cell][None]  # [1, 10, h, w]
        iou = np.minimum(obs, tpl).sum(axis=(2, 3)) / np.maximum(np.maximum(obs, tpl).sum(axis=(2, 3)), 1e-6)
        best = float(iou.max())
        if best < reader.min_iou:
            cells.append(CellReading(False))
            continue
        shape, obj_size = TEMPLATES[int(iou.max(0).argmax())]
        cells.append(CellReading(True, synthetic.COLOR_NAMES[k], shape, obj_size, best))
    return (synthetic.COLOR_NAMES[bg] if solid else ""), cells


def check_image(image: np.ndarray, scene: synthetic.Scene, reader: Reader = Reader()) -> dict[str, list[bool]]:
    """Every check the caption of `scene` implies, on `image`: attribute -> list of pass/fail (one entry for
    background and count, one per stated object for the others)."""
    bg, cells = read_image(image, reader)
    out = {a: [] for a in ATTRIBUTES}
    out["background"].append(bg == scene.background)
    out["count"].append(sum(c.occupied for c in cells) == len(scene.objects))
    for o in scene.objects:
        c = cells[o.cell]
        out["position"].append(c.occupied)
        out["color"].append(c.occupied and c.color == o.color)
        out["shape"].append(c.occupied and c.shape == o.shape)
        out["size"].append(c.occupied and c.size == o.size)
    return out


def score(images: np.ndarray, scenes: list[synthetic.Scene], reader: Reader = Reader()) -> dict[str, float]:
    """Caption alignment of `images` ([N, S, S, 3], uint8 or float in [-1, 1]) against their `scenes`.

    Returns {"align_<attribute>": fraction correct for each of ATTRIBUTES, "align_overall": their mean,
    "align_exact": fraction of images with every check right}.
    """
    if len(images) != len(scenes):
        raise ValueError(f"{len(images)} images but {len(scenes)} scenes")
    if not len(scenes):
        raise ValueError("score needs at least one image")
    passed = {a: [] for a in ATTRIBUTES}
    exact = []
    for image, scene in zip(images, scenes, strict=True):
        checks = check_image(image, scene, reader)
        for a in ATTRIBUTES:
            passed[a] += checks[a]
        exact.append(all(all(v) for v in checks.values()))
    out = {f"align_{a}": float(np.mean(passed[a])) for a in ATTRIBUTES}
    out["align_overall"] = float(np.mean([out[f"align_{a}"] for a in ATTRIBUTES]))
    out["align_exact"] = float(np.mean(exact))
    return out
