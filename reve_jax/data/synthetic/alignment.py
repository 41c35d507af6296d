"""Caption alignment on the procedural dataset, GenEval-style: every attribute a caption states is checked
against the pixels of the image generated for it, and the fraction of checks that pass is reported.

The reader knows only the image and the dataset's geometry (the 3x3 grid, the five shapes of `synthetic`), never
the scene or its rendering's variation. It works on a batch at once (numpy, vectorised over images and cells):

- background: a linear color field (the dataset's gradients) fitted to the pixels near the most common palette
  color, refitted on the pixels within a few noise widths of it. Its mean names the background; the robust spread
  of the pixels around it is the image's noise level. An image whose background pixels scatter more than
  `max_noise` (per channel, 0..255), or whose field covers under `min_background` of the pixels, has no
  background: noise around a mean color is not a solid background;
- per pixel, a color class: the pixel seen as a blend `field + a * (c - field)` of the local background and a
  palette color c, the way the renderer anti-aliases. A pixel at least half-way along such a segment (within the
  noise of it) takes c; one less than half-way is background; one on no segment takes its nearest color (so a
  global tint does not hide objects);
- per cell, the object: the color with most pixels in the cell; its coverage map `a` (against the object's own
  shade, measured in its interior, where it has one); a centroid and mass from those pixels, refined on a disc
  around the centroid within the cell and a rim of about a pixel at 32 px (an object pushed over the edge is seen
  nearly whole, and belongs to the cell that holds its center). Each shape is fitted by least squares to the
  coverage: its center is the centroid, its half-extent follows from the mass and the shape's area, its turn from
  the angular harmonic the shape has (4-fold for squares, diamonds and crosses, 3-fold for triangles), each tried
  at three scales and turns around those; the fixed rendering's exact templates are tried too. The best fit names
  the shape; its half-extent against the gap between the dataset's size classes names the size; the object's
  color is unmixed from the pixels with the fitted coverage (a cell whose unmixed color differs is read again). A
  cell holds an object when the disc's mass is at least half the smallest object's, the fit's soft IoU with the
  coverage (both lightly smoothed) reaches `min_iou`, the fitted center lies in the cell, and few of the cell's
  pixels are clutter (neither background nor a blend with the object's color): noise and smears hold none, so
  half-trained samples full of colored noise earn no count or position by luck.

Checks per image: background (1), count (1: occupied cells == stated objects), and per stated object position
(its cell holds an object), color, shape and size. As in GenEval, the attributes of an object that is not found
count as wrong. `score` returns the fraction correct per attribute, their mean ("overall") and the fraction of
images with every check right ("exact"); `check_batch` gives the per-image counts behind them (for bootstrap
intervals). Images larger than 64 px are average-pooled to 48-64 px first (what the shapes need, and a bounded
cost per image).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from reve_jax.data.synthetic import grammar, render

ATTRIBUTES = ("background", "count", "position", "color", "shape", "size")
# A reader guessing uniformly: 8 backgrounds, 7 object colors (never the background's), 5 shapes, 2 sizes; a cell
# is occupied or not; 1..max_objects objects (3 by default).
CHANCE = {"background": 1 / 8, "count": 1 / 3, "position": 1 / 2, "color": 1 / 7, "shape": 1 / 5, "size": 1 / 2}
PALETTE = np.array([grammar.COLORS[c] for c in grammar.COLOR_NAMES], np.float32)  # [8, 3] in 0..255
_SHAPES = grammar.SHAPES
# Area of each shape in units of r^2 (from its SDF): half-extent from mass, and the smallest object's mass.
_AREA = {"circle": math.pi, "square": (2 * 0.82) ** 2, "diamond": 2.0, "triangle": 1.75, "cross": 2.304}
# Turning symmetry used to read each shape's turn (0: none) and the turns the dataset draws.
_FOLD = {"circle": 0, "square": 4, "diamond": 4, "triangle": 3, "cross": 4}
_SIZE_SPLIT = 0.5 * (render.JITTER.small[1] + render.JITTER.large[0])  # r / cell width: small below
_REACH = 1.17  # every shape lies within this many r of its turning center
_WORK_MIN = 48  # images larger than 64 px are pooled to the smallest integer divisor size >= this


@dataclasses.dataclass(frozen=True)
class Reader:
    """Thresholds of the pixel reader (colors in 0..255 per channel). tol: least distance a pixel may lie off a
    background -> color segment and still vote (raised to 3 noise widths on noisy images); max_noise: largest
    noise level (robust per-channel std of the background) of an image with a background and objects;
    min_background: least share of the pixels on the fitted background; min_iou: least soft IoU of the best shape
    fit with a cell's coverage for the cell to hold an object; max_clutter: largest share of a cell's pixels
    explained neither as background nor as a blend of it with the object's color; scales, turn_step: the fit
    tries each shape at these multiples of the half-extent read from the mass, and at +-turn_step degrees
    around the turn read from the harmonics."""

    tol: float = 30.0
    max_noise: float = 40.0
    min_background: float = 0.5
    min_iou: float = 0.6
    max_clutter: float = 0.2
    scales: tuple[float, ...] = (0.92, 1.0, 1.08)
    turn_step: float = 6.0


DEFAULT_READER = Reader()


@dataclasses.dataclass(frozen=True)
class Readings:
    """What the reader sees in N images: background palette index or -1 (none) [N]; per cell (row-major)
    occupied [N, 9], color palette index, shape index into SHAPES, size index into SIZES (-1 when empty), the
    fit's soft IoU [N, 9]; noise: the estimated noise level per image [N]."""

    background: np.ndarray
    occupied: np.ndarray
    color: np.ndarray
    shape: np.ndarray
    size: np.ndarray
    iou: np.ndarray
    noise: np.ndarray

    def cell_names(self, i: int) -> list[tuple[str, str, str] | None]:
        """Image i's cells as (color, shape, size) names, None when empty."""
        return [
            (grammar.COLOR_NAMES[self.color[i, c]], _SHAPES[self.shape[i, c]], grammar.SIZES[self.size[i, c]])
            if self.occupied[i, c]
            else None
            for c in range(grammar.GRID**2)
        ]


def to_rgb255(images: np.ndarray) -> np.ndarray:
    """uint8 images in 0..255, or float images in [-1, 1] (the model's range) -> float32 in 0..255, same shape."""
    images = np.asarray(images)
    if images.dtype == np.uint8:
        return images.astype(np.float32)
    return np.clip((images.astype(np.float32) + 1.0) * 127.5, 0.0, 255.0)


def _pool(img: np.ndarray) -> np.ndarray:
    """[N, S, S, 3] -> average-pooled by the largest integer f with S / f >= _WORK_MIN (1 up to 64 px)."""
    s = img.shape[1]
    if s <= 64:
        return img
    f = max(k for k in range(1, s // _WORK_MIN + 1) if s % k == 0)
    return img.reshape(img.shape[0], s // f, f, s // f, f, 3).mean(axis=(2, 4))


# ------------------------------------------------------------------------------------------ background


@functools.lru_cache(maxsize=16)
def _basis(side: int) -> np.ndarray:
    """[P, 3]: 1, y, x (centered, in image widths) per pixel of a side x side image, row-major."""
    t = (np.arange(side, dtype=np.float32) + 0.5) / side - 0.5
    return np.stack([np.ones(side * side, np.float32), np.repeat(t, side), np.tile(t, side)], 1)


def _fit_field(img: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Per image, the least-squares affine color field c0 + cy*y + cx*x over pixels weighted by `weight`
    [N, P]: returns the field [N, P, 3] (img is [N, P, 3], pixels row-major on a square grid)."""
    basis = _basis(math.isqrt(img.shape[1]))
    wb = np.swapaxes(weight[:, :, None] * basis, 1, 2)  # [N, 3, P]
    coef = np.linalg.solve(wb @ basis + 1e-3 * np.eye(3, dtype=np.float32), wb @ img)  # [N, 3, 3]
    return basis @ coef


def _background(img: np.ndarray, reader: Reader):
    """img [N, P, 3] -> (palette index [N], field [N, P, 3], noise level [N], share of pixels on the field [N],
    on-field mask [N, P])."""
    d2 = np.square(img[:, :, None, :] - PALETTE).sum(-1)  # [N, P, 8]
    nearest = d2.argmin(-1)
    counts = np.stack([np.bincount(row, minlength=len(PALETTE)) for row in nearest])
    mode = counts.argmax(1)
    weight = (np.take_along_axis(d2, mode[:, None, None], 2)[..., 0] < 70.0**2).astype(np.float32)
    field = _fit_field(img, weight)
    for _ in range(3):  # refit on the pixels within a few noise widths of the field: objects drop out
        err = img - field
        # Noise level: median absolute deviation per channel over the pixels kept (objects left out, so it holds
        # even for scenes mostly covered by objects), as a Gaussian's standard deviation.
        dev = np.sort(np.where(weight[..., None] > 0, np.abs(err), np.inf), axis=1)
        kept = weight.sum(1).astype(int)
        med = np.take_along_axis(dev, np.maximum(kept // 2, 0)[:, None, None], 1)[:, 0]  # [N, 3]
        noise = np.where(kept > 0, 1.4826 * np.mean(np.minimum(med, 255.0), -1), 255.0)
        thr = np.maximum(reader.tol, 4.0 * noise)
        weight = (np.square(err).sum(-1) < np.square(thr)[:, None]).astype(np.float32)
        field = _fit_field(img, weight)
    # The level reported (and held against max_noise) is the RMS over the pixels kept: unlike the median, it
    # sees noise that clipping at 0 or 255 left exactly white or black in half the pixels.
    err2 = np.square(img - field).sum(-1)
    noise = np.maximum(noise, np.sqrt((weight * err2).sum(1) / np.maximum(3.0 * weight.sum(1), 1.0)))
    mean = field.mean(1)  # [N, 3]
    bg = np.square(mean[:, None] - PALETTE).sum(-1).argmin(1)
    return bg, field, noise, weight.mean(1), weight > 0


# ------------------------------------------------------------------------------------------ cells


@functools.lru_cache(maxsize=16)
def _cell_windows(size: int):
    """Per cell: window origin (y0, x0) [9, 2] in the padded image, window side W, ownership mask [9, W, W]
    (pixels of the cell itself), pad, the cell bounds [9, 4] (y0, y1, x0, x1) in image pixels, and the fit
    region [9, W, W] (the cell grown by a rim)."""
    edges = [int(np.ceil(k * size / grammar.GRID - 0.5)) for k in range(grammar.GRID + 1)]
    width = max(b - a for a, b in zip(edges, edges[1:], strict=False))
    # The fit's region: the cell and a rim of about a pixel at 32 px, so an object over the edge is seen nearly
    # whole while a neighbour's object (at least two margins away) barely shows.
    rim = max(1, round(0.08 * size / grammar.GRID))
    pad = rim + 1
    side = width + 2 * pad
    bounds = np.array([(edges[r], edges[r + 1], edges[c], edges[c + 1]) for r in range(3) for c in range(3)])
    origin = bounds[:, [0, 2]]  # window pixel (i, j) is image pixel origin + (i, j) - pad
    k = np.arange(side)
    own_y = (origin[:, 0, None] + k - pad >= bounds[:, 0, None]) & (origin[:, 0, None] + k - pad < bounds[:, 1, None])
    own_x = (origin[:, 1, None] + k - pad >= bounds[:, 2, None]) & (origin[:, 1, None] + k - pad < bounds[:, 3, None])
    own = own_y[:, :, None] & own_x[:, None, :]
    region = own.copy()
    for _ in range(rim):
        grown = region.copy()
        grown[:, 1:] |= region[:, :-1]
        grown[:, :-1] |= region[:, 1:]
        grown[:, :, 1:] |= region[:, :, :-1]
        grown[:, :, :-1] |= region[:, :, 1:]
        region = grown
    return origin, side, own, pad, bounds, region


def _windows(arr: np.ndarray, size: int, fill: float) -> np.ndarray:
    """[N, S, S, ...] -> [N, 9, W, W, ...]: each cell's window, padded beyond the image with `fill`."""
    origin, side, _, pad, _, _ = _cell_windows(size)
    widths = [(0, 0), (pad, side), (pad, side)] + [(0, 0)] * (arr.ndim - 3)
    padded = np.pad(arr, widths, constant_values=fill)
    k = np.arange(side)
    rows = (origin[:, 0, None] + k)[:, :, None]  # [9, W, 1]
    cols = (origin[:, 1, None] + k)[:, None, :]  # [9, 1, W]
    return padded[:, rows, cols]


@functools.lru_cache(maxsize=8)
def _phase0() -> dict[str, complex]:
    """Unit harmonic (order _FOLD) of each unturned shape, measured on a large render: the reference turns are
    read against (same sign conventions as `render.shape_coverage`)."""
    t = np.arange(-40, 40, dtype=np.float64) + 0.5
    dy, dx = t[:, None], t[None, :]
    z = dy + 1j * dx
    out = {}
    for s, n in _FOLD.items():
        if n:
            h = (render.shape_coverage(s, dy, dx, 30.0, 0.0) * z**n).sum()
            out[s] = h / abs(h)
    return out


def _turns(h: dict[int, np.ndarray], shape: str, step: float) -> np.ndarray:
    """Candidate turns (degrees) of `shape` per object from its harmonics h[n] [M]: [M, 3] (zeros for circles)."""
    n = _FOLD[shape]
    if not n:
        return np.zeros((len(h[4]), 1))
    period = 360.0 / n
    turn = np.degrees(np.angle(h[n] / _phase0()[shape])) / n  # in (-period/2, period/2]
    limit = render.JITTER.rotation_deg[shape]
    turn = np.clip(turn, -limit, limit) if limit < period / 2 else turn
    return turn[:, None] + np.array([-step, 0.0, step])


def _smooth(x: np.ndarray) -> np.ndarray:
    """[..., H, W] -> the same under a 3x3 binomial filter (zeros beyond the edges)."""
    p = np.pad(x, [(0, 0)] * (x.ndim - 2) + [(1, 1), (1, 1)])
    y = 0.25 * p[..., :-2, :] + 0.5 * p[..., 1:-1, :] + 0.25 * p[..., 2:, :]
    return 0.25 * y[..., :-2] + 0.5 * y[..., 1:-1] + 0.25 * y[..., 2:]


@functools.lru_cache(maxsize=16)
def _fixed_templates(size: int) -> np.ndarray:
    """Coverage of every (shape, size) in the fixed rendering's place, per cell window: float32 [9, 10, W, W]
    (shape-major: index = shape * 2 + size). Fixed renders, and the jittered ones at the smallest sizes, sit
    exactly there: these templates read them where moments of a few pixels could not."""
    out = []
    for cell in range(grammar.GRID**2):
        maps = [
            render.object_coverage(grammar.SceneObject(shape, "red", sz, cell), size)
            for shape in _SHAPES
            for sz in grammar.SIZES
        ]
        out.append(np.moveaxis(_windows(np.stack(maps, -1)[None], size, 0.0)[0, cell], -1, 0))
    return np.stack(out).astype(np.float32)


def _fit_shapes(a, disc, cy, cx, mass, reader: Reader, fixed: np.ndarray, cell_w: float):
    """Least-squares shape fit of coverage maps a [M, W, W] around centers (cy, cx) [M] with masses [M] (turns
    read from the harmonics of the coverage on `disc` [M, W, W], the pixels near the center), also
    against each cell's fixed-rendering templates `fixed` [M, 10, W, W] (cells `cell_w` pixels wide). Returns
    (shape index [M], half-extent in pixels [M], fitted coverage [M, W, W])."""
    m, side = a.shape[0], a.shape[1]
    k = np.arange(side, dtype=np.float32) + 0.5
    dy = k[None, :, None] - cy[:, None, None]  # [M, W, 1]
    dx = k[None, None, :] - cx[:, None, None]  # [M, 1, W]
    w = np.where(disc, np.clip(a, 0.0, 1.0), 0.0)
    z = dy + 1j * dx
    h = {n: (w * z**n).sum(axis=(1, 2)) for n in (3, 4)}
    target = np.clip(a, -0.5, 1.5)
    best_err = np.full(m, np.inf)
    best_shape = np.zeros(m, np.int64)
    best_r = np.zeros(m)
    best_cov = np.zeros_like(a)
    scales = np.asarray(reader.scales)
    for si, shape in enumerate(_SHAPES):
        r = np.sqrt(np.maximum(mass, 1e-3) / _AREA[shape])[:, None] * scales  # [M, R]
        turns = _turns(h, shape, reader.turn_step)  # [M, T]
        rr = np.repeat(r, turns.shape[1], 1)  # [M, R*T]
        tt = np.tile(turns, (1, r.shape[1]))
        cov = render.shape_coverage(shape, dy[:, None], dx[:, None], rr[:, :, None, None], tt[:, :, None, None]).astype(
            np.float32
        )  # [M, K, W, W]
        err = np.square(cov - target[:, None]).sum(axis=(2, 3))  # [M, K]
        j = err.argmin(1)
        e, fit = err[np.arange(m), j], cov[np.arange(m), j]
        better = e < best_err
        best_err = np.where(better, e, best_err)
        best_shape = np.where(better, si, best_shape)
        best_r = np.where(better, rr[np.arange(m), j], best_r)
        best_cov = np.where(better[:, None, None], fit, best_cov)
    err = np.square(fixed - target[:, None]).sum(axis=(2, 3))  # [M, 10]
    j = err.argmin(1)
    better = err[np.arange(m), j] < best_err
    fixed_r = np.array([grammar.SIZE_EXTENT[sz] for sz in grammar.SIZES])[j % 2] * cell_w
    best_shape = np.where(better, j // 2, best_shape)
    best_r = np.where(better, fixed_r, best_r)
    best_cov = np.where(better[:, None, None], fixed[np.arange(m), j], best_cov)
    return best_shape, best_r, best_cov


def read_batch(images: np.ndarray, reader: Reader = DEFAULT_READER, chunk: int = 64) -> Readings:
    """Reads images (uint8, or float in [-1, 1]; [N, S, S, 3]), `chunk` at a time; returns Readings."""
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[1] != images.shape[2] or images.shape[3] != 3:
        raise ValueError(f"expected square RGB images [N, S, S, 3], got shape {images.shape}")
    parts = [_read_chunk(images[i : i + chunk], reader) for i in range(0, len(images), chunk)]
    return Readings(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(Readings)))


def _classify(flat: np.ndarray, field: np.ndarray, bg: np.ndarray, tol: np.ndarray) -> np.ndarray:
    """Each pixel's color class: int [N, P], a palette index, the background's own index for background.

    A pixel at least half-way along a background -> color segment (within `tol` [N] of it; the nearest such
    segment) takes that color, as the renderer's anti-aliased blends do; one less than half-way along a segment is
    background; one on no segment takes the nearest of the local background (the field) and the other palette
    colors, which stays right under a global tint."""
    n = flat.shape[0]
    d2 = np.square(flat[:, :, None] - PALETTE).sum(-1)  # [N, P, 8]
    np.put_along_axis(d2, bg[:, None, None], np.square(flat - field).sum(-1)[..., None], 2)
    cls = d2.argmin(-1)
    # Blends, with D = palette color - field: a = delta.D / |D|^2 and |delta - clip(a) D|^2 from [*, 3] x [3, 8].
    delta = flat - field
    dd = delta @ PALETTE.T - (delta * field).sum(-1, keepdims=True)  # delta . D
    norm2 = np.square(PALETTE).sum(-1) - 2.0 * field @ PALETTE.T + np.square(field).sum(-1, keepdims=True)
    norm2 = np.maximum(norm2, 1.0)
    a = dd / norm2
    ac = np.clip(a, 0.0, 1.0)
    resid2 = np.square(delta).sum(-1, keepdims=True) - 2.0 * ac * dd + ac * ac * norm2
    on_seg = resid2 <= np.square(tol)[:, None, None]
    on_seg[np.arange(n), :, bg] = False
    ok = on_seg & (a >= 0.5)
    blend = np.where(ok, resid2, np.inf).argmin(-1)
    faint = (on_seg & (a < 0.5)).any(-1)  # a light blend: background, not a color of its own
    return np.where(ok.any(-1), blend, np.where(faint, bg[:, None], cls))


def _locate(a_w: np.ndarray, core: np.ndarray, own: np.ndarray, region: np.ndarray):
    """Centroid (cy, cx) in window pixels, masses and the fit region of each cell's object from its coverage
    a_w [N, 9, W, W] and confident pixels `core`: the centroid and mass of the confident pixels in the cell,
    then twice re-measured on a disc around the centroid within `region` (the cell and a rim). Returns
    (cy, cx, m0 (confident mass), mass (disc mass, unclipped so noise averages out), disc [N, 9, W, W])."""
    k = np.arange(a_w.shape[-1], dtype=np.float32) + 0.5
    w0 = np.where(core & own, np.clip(a_w, 0, 1), 0.0)
    m0 = w0.sum(axis=(2, 3))
    cy = (w0 * k[:, None]).sum(axis=(2, 3)) / np.maximum(m0, 1e-6)
    cx = (w0 * k[None, :]).sum(axis=(2, 3)) / np.maximum(m0, 1e-6)
    mass = m0
    for _ in range(2):
        radius = _REACH * np.sqrt(np.maximum(mass, 1.0) / min(_AREA.values())) + 1.5
        d2 = np.square(k[:, None] - cy[..., None, None]) + np.square(k[None, :] - cx[..., None, None])
        disc = (d2 <= np.square(radius)[..., None, None]) & region
        mass = np.maximum(np.where(disc, np.clip(a_w, -1.0, 2.0), 0.0).sum(axis=(2, 3)), 0.0)
        wp = np.where(disc, np.clip(a_w, 0.0, 1.0), 0.0)
        mp = np.maximum(wp.sum(axis=(2, 3)), 1e-6)
        cy, cx = (wp * k[:, None]).sum(axis=(2, 3)) / mp, (wp * k[None, :]).sum(axis=(2, 3)) / mp
    return cy, cx, m0, mass, disc


def _read_chunk(images: np.ndarray, reader: Reader) -> Readings:
    img = _pool(to_rgb255(images))
    n, s = img.shape[0], img.shape[1]
    flat = img.reshape(n, s * s, 3)
    bg, field, noise, on_bg, near_bg = _background(flat, reader)
    has_bg = (noise <= reader.max_noise) & (on_bg >= reader.min_background)
    cls = _classify(flat, field, bg, np.maximum(reader.tol, 3.0 * noise))
    origin, side, own, pad, bounds, region = _cell_windows(s)
    win = lambda arr, fill: _windows(arr.reshape(n, s, s, *arr.shape[2:]), s, fill)  # noqa: E731
    cls_w, near_w = win(cls, -1), win(near_bg, True)
    pix_w, field_w = win(flat, 0.0), win(field, 0.0)  # [N, 9, W, W, 3]
    votes = np.stack([((cls_w == k) & own).sum(axis=(2, 3)) for k in range(len(PALETTE))], -1)
    votes[np.arange(n), :, bg] = 0
    color = votes.argmax(-1)  # [N, 9]
    voted = votes.max(-1) > 0  # a cell without a pixel of any object color holds nothing
    tol = np.maximum(reader.tol, 3.0 * noise)[:, None, None, None]
    cell_w = s / grammar.GRID
    # Half the smallest object's area at this size (the dataset keeps 16 px objects at the fixed sizes).
    g = render.geometry_strength(images.shape[1])
    r_min = grammar.SIZE_EXTENT["small"] + g * (render.JITTER.small[0] - grammar.SIZE_EXTENT["small"])
    min_mass = 0.5 * min(_AREA.values()) * (r_min * cell_w) ** 2
    shape = np.full((n, 9), -1)
    size = np.full((n, 9), -1)
    iou = np.zeros((n, 9))
    cand = np.zeros((n, 9), bool)
    todo = np.ones((n, 9), bool)
    delta_w = pix_w - field_w
    core = np.zeros_like(cls_w, dtype=bool)
    for _ in range(2):  # a second pass for cells whose unmixed color differs from the voted one
        # The object's pixels: those of its color, and on a second pass those it was read from before (an orange
        # object on red is also a 58% blend of yellow: its pixels may have voted yellow).
        core = ((cls_w == color[..., None, None]) | (core & todo[..., None, None])) & voted[..., None, None]
        # The object's own color: the mean of its interior (pixels of its class whose four neighbours are too,
        # so no anti-aliased edge), or the palette color for objects too small to have an interior.
        inner = core & own
        for axis, sl in ((2, np.s_[1:]), (2, np.s_[:-1]), (3, np.s_[1:]), (3, np.s_[:-1])):
            src = np.s_[:-1] if sl == np.s_[1:] else np.s_[1:]
            idx_dst = (slice(None),) * axis + (sl,)
            idx_src = (slice(None),) * axis + (src,)
            shifted = np.zeros_like(core)
            shifted[idx_dst] = core[idx_src]
            inner &= shifted
        n_inner = inner.sum(axis=(2, 3))
        mean_inner = (inner[..., None] * delta_w).sum(axis=(2, 3)) / np.maximum(n_inner, 1)[..., None]
        palette_delta = PALETTE[color][:, :, None, None] - field_w  # [N, 9, W, W, 3]
        dirs = np.where((n_inner >= 3)[..., None, None, None], mean_inner[:, :, None, None], palette_delta)
        norm2 = np.maximum(np.square(dirs).sum(-1), 1.0)
        a_w = (delta_w * dirs).sum(-1) / norm2
        resid = np.linalg.norm(delta_w - np.clip(a_w, 0.0, 1.0)[..., None] * dirs, axis=-1)
        seg_w = resid <= tol
        cy, cx, m0, mass, disc = _locate(a_w, core, own, region)
        py, px = cy - pad + origin[None, :, 0], cx - pad + origin[None, :, 1]  # image pixels
        inside = (py >= bounds[:, 0]) & (py < bounds[:, 1]) & (px >= bounds[:, 2]) & (px < bounds[:, 3])
        explained = (near_w | (seg_w & (a_w > 0))) & own
        clutter = 1.0 - explained.sum(axis=(2, 3)) / own.sum(axis=(1, 2))
        # The mass on the disc (not only the confident pixels'): a blurred small object keeps its mass.
        enough = (mass >= min_mass) & (m0 > 0)
        now = todo & voted & has_bg[:, None] & enough & inside & (clutter <= reader.max_clutter)
        cand = np.where(todo, now, cand)
        if not now.any():
            break
        ii, cc = np.nonzero(now)
        target = np.where(region[cc], a_w[ii, cc], 0.0)
        sh, r, cov = _fit_shapes(
            target, disc[ii, cc], cy[ii, cc], cx[ii, cc], mass[ii, cc], reader, _fixed_templates(s)[cc], cell_w
        )
        # Soft IoU of the fit with the coverage, both lightly smoothed so pixel noise does not count as misfit.
        obs, fit = np.clip(_smooth(np.where(disc[ii, cc], target, 0.0)), 0.0, 1.0), _smooth(cov)
        iou[ii, cc] = np.minimum(obs, fit).sum(axis=(1, 2)) / np.maximum(np.maximum(obs, fit).sum(axis=(1, 2)), 1e-6)
        shape[ii, cc] = sh
        size[ii, cc] = (r / cell_w >= _SIZE_SPLIT).astype(int)
        # The object's color unmixed with the fitted coverage T: pixel = field + T (c - field), least squares.
        t = cov[..., None]
        d_hat = (t * delta_w[ii, cc]).sum(axis=(1, 2)) / np.maximum(np.square(t).sum(axis=(1, 2)), 1e-6)
        f_hat = (t * field_w[ii, cc]).sum(axis=(1, 2)) / np.maximum(t.sum(axis=(1, 2)), 1e-6)
        d2 = np.square(f_hat + d_hat - PALETTE[:, None]).sum(-1).T  # [M, 8]
        d2[np.arange(len(ii)), bg[ii]] = np.inf
        unmixed = d2.argmin(1)
        todo = np.zeros((n, 9), bool)
        todo[ii, cc] = unmixed != color[ii, cc]
        color[ii, cc] = unmixed
        if not todo.any():
            break
    occupied = cand & (iou >= reader.min_iou)
    return Readings(
        background=np.where(has_bg, bg, -1),
        occupied=occupied,
        color=np.where(occupied, color, -1),
        shape=np.where(occupied, shape, -1),
        size=np.where(occupied, size, -1),
        iou=iou,
        noise=noise,
    )


# ------------------------------------------------------------------------------------------ checks and scores


def check_batch(readings: Readings, scenes: list[grammar.Scene]) -> dict[str, np.ndarray]:
    """Per image, the checks the caption of each scene implies: attribute -> (passed [N], total [N]) stacked as
    int [N, 2] (background and count: one check each; the others one per stated object)."""
    n = len(scenes)
    if readings.occupied.shape[0] != n:
        raise ValueError(f"{readings.occupied.shape[0]} readings but {n} scenes")
    out = {a: np.zeros((n, 2), np.int64) for a in ATTRIBUTES}
    for i, scene in enumerate(scenes):
        bg = grammar.COLOR_NAMES.index(scene.background)
        out["background"][i] = (readings.background[i] == bg, 1)
        out["count"][i] = (readings.occupied[i].sum() == len(scene.objects), 1)
        for o in scene.objects:
            c = o.cell
            found = bool(readings.occupied[i, c])
            checks = {
                "position": found,
                "color": found and readings.color[i, c] == grammar.COLOR_NAMES.index(o.color),
                "shape": found and readings.shape[i, c] == _SHAPES.index(o.shape),
                "size": found and readings.size[i, c] == grammar.SIZES.index(o.size),
            }
            for attr, ok in checks.items():
                out[attr][i] += (int(ok), 1)
    return out


def summarize(checks: dict[str, np.ndarray]) -> dict[str, float]:
    """Scores from per-image checks (check_batch): {"align_<attribute>": passed / total over all images,
    "align_overall": their mean, "align_exact": share of images with every check right}."""
    out = {f"align_{a}": float(checks[a][:, 0].sum() / max(checks[a][:, 1].sum(), 1)) for a in ATTRIBUTES}
    out["align_overall"] = float(np.mean([out[f"align_{a}"] for a in ATTRIBUTES]))
    exact = np.all([checks[a][:, 0] == checks[a][:, 1] for a in ATTRIBUTES], axis=0)
    out["align_exact"] = float(np.mean(exact))
    return out


def by_group(checks: dict[str, np.ndarray], scenes: list[grammar.Scene], heldout) -> dict[str, dict[str, float]]:
    """Where the checks (check_batch) fail: align_exact and align_shape, with the number of images, over the images
    grouped by which held-out pairs their caption holds (split.Compositions.kinds: "held-out color-shape",
    "held-out shape-cell", "held-out both", "no held-out pair") and by their objects' size ("small", "large",
    "mixed"). Groups without images are left out."""
    kinds = ["held-out color-shape", "held-out shape-cell", "held-out both", "no held-out pair"]
    order = [*kinds, *grammar.SIZES, "mixed"]
    groups: dict[str, list[int]] = {g: [] for g in order}
    for i, scene in enumerate(scenes):
        kind = heldout.kinds(scene)
        sizes = {o.size for o in scene.objects}
        groups["no held-out pair" if kind == "none" else f"held-out {kind}"].append(i)
        groups[sizes.pop() if len(sizes) == 1 else "mixed"].append(i)
    out = {}
    for g, idx in groups.items():
        if not idx:
            continue
        s = summarize({a: v[idx] for a, v in checks.items()})
        out[g] = {"n": len(idx), "align_exact": s["align_exact"], "align_shape": s["align_shape"]}
    return out


def score(images: np.ndarray, scenes: list[grammar.Scene], reader: Reader = DEFAULT_READER) -> dict[str, float]:
    """Caption alignment of `images` ([N, S, S, 3], uint8 or float in [-1, 1]) against their `scenes`.

    Returns {"align_<attribute>": fraction correct for each of ATTRIBUTES, "align_overall": their mean,
    "align_exact": fraction of images with every check right}.
    """
    if len(images) != len(scenes):
        raise ValueError(f"{len(images)} images but {len(scenes)} scenes")
    if not len(scenes):
        raise ValueError("score needs at least one image")
    return summarize(check_batch(read_batch(images, reader), scenes))


def check_image(image: np.ndarray, scene: grammar.Scene, reader: Reader = DEFAULT_READER) -> dict[str, list[bool]]:
    """Every check the caption of `scene` implies on one image [S, S, 3]: attribute -> list of pass/fail (one
    entry for background and count, one per stated object for the others)."""
    r = read_batch(np.asarray(image)[None], reader)
    bg = grammar.COLOR_NAMES.index(scene.background)
    out = {"background": [bool(r.background[0] == bg)], "count": [int(r.occupied[0].sum()) == len(scene.objects)]}
    cells = r.cell_names(0)
    for attr, idx in (("position", None), ("color", 0), ("shape", 1), ("size", 2)):
        out[attr] = [
            cells[o.cell] is not None and (idx is None or cells[o.cell][idx] == (o.color, o.shape, o.size)[idx])
            for o in scene.objects
        ]
    return out
