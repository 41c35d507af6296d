"""The synthetic dataset's renderer: a scene's geometry, the fixed rendering (one image per caption) and the
jittered one (a distribution of images per caption: `Style`)."""

import dataclasses
import math
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from reve_jax.config import CHOICES
from reve_jax.data.synthetic.grammar import COLORS, GRID, SHAPES, SIZE_EXTENT, Scene, SceneObject

RENDERS: tuple[str, ...] = CHOICES["data.render"]  # ("jitter", "fixed")


@dataclasses.dataclass(frozen=True)
class Jitter:
    """Bounds of the "jitter" rendering's variation. Lengths are in cell widths (image_size / 3), colors in 0..255.

    small, large: ranges of an object's half-extent r per size class (the fixed rendering's 0.24 and 0.42 lie in
      them; a gap keeps the classes apart for every shape); margin: least distance between an object and its
      cell's edge (objects of neighbouring cells never touch); rotation_deg: largest turn per shape (+-);
      shade: largest per-channel offset of an object's or the background's color from its palette color (every
      two palette colors are at least 81 apart, so a shade stays nearest its own); gradient: largest per-channel
      change of the background from its center to an edge; texture: largest amplitude of the background's
      smooth texture (a sum of a few low-frequency waves, the same in every channel); fixed_upto, full_from:
      image sizes (px) up to which objects keep the fixed rendering's geometry (centered, two exact sizes, upright)
      and shade, and from which they vary fully, linearly in between (`geometry_strength`): below about 32 px a
      small object spans under five pixels, and its shape is legible only where it sits as the fixed rendering
      puts it. The background varies fully at every size.
    """

    small: tuple[float, float] = (0.18, 0.25)
    large: tuple[float, float] = (0.34, 0.42)
    margin: float = 0.04
    rotation_deg: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: MappingProxyType(
            {"circle": 0.0, "square": 15.0, "diamond": 15.0, "triangle": 60.0, "cross": 15.0}
        )
    )
    shade: float = 14.0
    gradient: float = 14.0
    texture: float = 5.0
    fixed_upto: int = 16
    full_from: int = 32


JITTER = Jitter()


def geometry_strength(image_size: int, jitter: Jitter = JITTER) -> float:
    """Share in [0, 1] of the objects' variation (position, size, turn, shade) an image of `image_size` px gets."""
    span = jitter.full_from - jitter.fixed_upto
    return float(np.clip((image_size - jitter.fixed_upto) / span, 0.0, 1.0))


_TEXTURE_WAVES = 3


def cell_center(cell: int, image_size: int) -> tuple[float, float]:
    """Returns (y, x) in pixel units (pixel i spans [i, i+1)) of the center of grid cell `cell`."""
    step = image_size / GRID
    return ((cell // GRID + 0.5) * step, (cell % GRID + 0.5) * step)


def object_radius(size: str, image_size: int) -> float:
    """Half-extent in pixels of an object of size `size` in an image of `image_size` pixels."""
    return SIZE_EXTENT[size] * image_size / GRID


def _box_sdf(y: np.ndarray, x: np.ndarray, hy: float, hx: float) -> np.ndarray:
    qy, qx = np.abs(y) - hy, np.abs(x) - hx
    outside = np.hypot(np.maximum(qy, 0.0), np.maximum(qx, 0.0))
    return outside + np.minimum(np.maximum(qy, qx), 0.0)


def _shape_sdf(shape: str, y: np.ndarray, x: np.ndarray, r: float) -> np.ndarray:
    """Signed distance in pixels (negative inside) to a shape of half-extent r centered at the origin."""
    if shape == "circle":
        return np.hypot(y, x) - r
    if shape == "square":
        return _box_sdf(y, x, 0.82 * r, 0.82 * r)  # slightly inset so its area is close to the circle's
    if shape == "diamond":
        return (np.abs(y) + np.abs(x) - r) / math.sqrt(2.0)
    if shape == "triangle":
        # Upward isosceles triangle: apex (y=-r, x=0), base at y=0.75r from x=-r to x=r (y grows downwards).
        top, base, half = -r, 0.75 * r, r
        h = base - top
        side = (np.abs(x) * h - (y - top) * half) / math.hypot(h, half)
        return np.maximum(side, y - base)
    if shape == "cross":
        long_, thin = 0.92 * r, 0.4 * r
        return np.minimum(_box_sdf(y, x, long_, thin), _box_sdf(y, x, thin, long_))
    raise ValueError(f"unknown shape {shape!r}; known: {SHAPES}")


def _coverage_patch(
    obj: SceneObject, image_size: int, offset: tuple[float, float] = (0.0, 0.0)
) -> tuple[int, int, np.ndarray]:
    """Coverage in [0, 1] of `obj`, its center moved by `offset` (dy, dx) pixels from its cell's center, over the
    pixels of its bounding box: returns (y0, x0, coverage [h, w])."""
    cy, cx = cell_center(obj.cell, image_size)
    cy, cx = cy + offset[0], cx + offset[1]
    r = object_radius(obj.size, image_size)
    y0, y1 = max(0, math.floor(cy - r - 1)), min(image_size, math.ceil(cy + r + 1))
    x0, x1 = max(0, math.floor(cx - r - 1)), min(image_size, math.ceil(cx + r + 1))
    y = (np.arange(y0, y1, dtype=np.float32) + 0.5 - cy)[:, None]
    x = (np.arange(x0, x1, dtype=np.float32) + 0.5 - cx)[None, :]
    # Analytic anti-aliasing: a pixel whose center is d pixels outside an edge is covered about 0.5 - d.
    cov = np.clip(0.5 - _shape_sdf(obj.shape, y, x, r), 0.0, 1.0)
    return y0, x0, cov.astype(np.float32)


def object_coverage(obj: SceneObject, image_size: int) -> np.ndarray:
    """Returns float32 [image_size, image_size] in [0, 1]: how much of each pixel `obj` covers when drawn."""
    y0, x0, cov = _coverage_patch(obj, image_size)
    full = np.zeros((image_size, image_size), np.float32)
    full[y0 : y0 + cov.shape[0], x0 : x0 + cov.shape[1]] = cov
    return full


def render_scene(scene: Scene, image_size: int, offsets: np.ndarray | None = None) -> np.ndarray:
    """Draws `scene` anti-aliased; `offsets` [objects, 2]: each object's center moved by (dy, dx) pixels from its
    cell's center (None: centered, the fixed rendering). Returns uint8 [image_size, image_size, 3]."""
    img = np.empty((image_size, image_size, 3), np.uint8)
    img[:] = COLORS[scene.background]
    # Blend in float only inside each object's box (the bulk of a large image is plain background).
    for i, obj in enumerate(scene.objects):
        y0, x0, cov = _coverage_patch(obj, image_size, (0.0, 0.0) if offsets is None else tuple(offsets[i]))
        window = (slice(y0, y0 + cov.shape[0]), slice(x0, x0 + cov.shape[1]))
        patch = img[window].astype(np.float32)
        patch += cov[..., None] * (np.asarray(COLORS[obj.color], np.float32) - patch)
        img[window] = np.rint(patch).astype(np.uint8)
    return img


# ------------------------------------------------------------------------------------------ jittered rendering

_TRI_C = 0.5625 / 3.5  # the triangle's circumcenter lies this far (times r) below its SDF origin: turn about it
_CROSS_LONG, _CROSS_THIN = 0.92, 0.4
_SQUARE_HALF = 0.82


@dataclasses.dataclass(frozen=True)
class ObjectStyle:
    """How one object of a jittered scene is drawn: its center's offset (dy, dx) from its cell's center and its
    half-extent r, in cell widths; its turn in degrees; its RGB shade in 0..255."""

    dy: float
    dx: float
    r: float
    angle: float
    rgb: tuple[float, float, float]


@dataclasses.dataclass(frozen=True)
class Style:
    """How a jittered scene is drawn: the background's RGB shade, its linear gradient (per-channel change from the
    image's center to its far edge along direction `gradient_dir`, radians), its texture waves (amplitude, cycles
    per image along y and x, phase) and one ObjectStyle per object in caption order."""

    rgb: tuple[float, float, float]
    gradient: tuple[float, float, float]
    gradient_dir: float
    waves: tuple[tuple[float, float, float, float], ...]
    objects: tuple[ObjectStyle, ...]


def _outline(shape: str, r: float) -> np.ndarray:
    """Corner points (u, v) of a polygonal shape of half-extent r around its turning center: float64 [k, 2]."""
    if shape == "square":
        h = _SQUARE_HALF * r
        return np.array([(h, h), (h, -h), (-h, h), (-h, -h)])
    if shape == "diamond":
        return np.array([(r, 0.0), (-r, 0.0), (0.0, r), (0.0, -r)])
    if shape == "triangle":
        return np.array([(-r - _TRI_C * r, 0.0), (0.75 * r - _TRI_C * r, r), (0.75 * r - _TRI_C * r, -r)])
    if shape == "cross":
        a, b = _CROSS_LONG * r, _CROSS_THIN * r
        return np.array([(a, b), (a, -b), (-a, b), (-a, -b), (b, a), (b, -a), (-b, a), (-b, -a)])
    raise ValueError(f"unknown shape {shape!r}; known: {SHAPES}")


def shape_extent(shape: str, r: float, angle: float) -> tuple[float, float]:
    """Half-extents (along y, along x) of `shape` of half-extent r turned by `angle` degrees, in r's units."""
    if shape == "circle":
        return r, r
    a = math.radians(angle)
    u, v = _outline(shape, r).T
    ys, xs = math.cos(a) * u - math.sin(a) * v, math.sin(a) * u + math.cos(a) * v
    return float(np.abs(ys).max()), float(np.abs(xs).max())


def shape_sdf(shape: str, u: np.ndarray, v: np.ndarray, r) -> np.ndarray:
    """Signed distance (negative inside) to `shape` of half-extent r (scalar or array, broadcast) at object-frame
    points (u down, v right) around its turning center: the jittered rendering's geometry, also the reader's."""
    if shape == "circle":
        return np.hypot(u, v) - r
    if shape == "square":
        return _box_sdf(u, v, _SQUARE_HALF * r, _SQUARE_HALF * r)
    if shape == "diamond":
        return (np.abs(u) + np.abs(v) - r) / math.sqrt(2.0)
    if shape == "triangle":
        y = u + _TRI_C * r  # back to the frame with the apex at -r and the base at 0.75 r
        side = (np.abs(v) * 1.75 - (y + r)) / math.hypot(1.75, 1.0)
        return np.maximum(side, y - 0.75 * r)
    if shape == "cross":
        long_, thin = _CROSS_LONG * r, _CROSS_THIN * r
        return np.minimum(_box_sdf(u, v, long_, thin), _box_sdf(u, v, thin, long_))
    raise ValueError(f"unknown shape {shape!r}; known: {SHAPES}")


def shape_coverage(shape: str, dy: np.ndarray, dx: np.ndarray, r, angle) -> np.ndarray:
    """Anti-aliased coverage in [0, 1] of `shape` (half-extent r, turned by `angle` degrees; both scalars or arrays
    that broadcast) at pixel-center offsets (dy, dx) from its center, all in pixels."""
    a = np.radians(angle)
    c, s = np.cos(a), np.sin(a)
    u, v = c * dy + s * dx, c * dx - s * dy
    return np.clip(0.5 - shape_sdf(shape, u, v, r), 0.0, 1.0)


def sample_style(rng: np.random.Generator, scene: Scene, jitter: Jitter = JITTER, strength: float = 1.0) -> Style:
    """Draws how `scene` is drawn (see Jitter for the bounds): background, then each object in caption order.
    strength in [0, 1] scales the objects' variation (`geometry_strength`): each object's position, size, turn
    and shade lie that share of the way from the fixed rendering's to the drawn ones (the draws themselves do not
    depend on it). A 16 px object of a few pixels shows its shape only through its exact coverage, which a
    different position or a darker shade would change as much as a different shape."""
    shade = lambda name, k=1.0: tuple(  # noqa: E731
        np.clip(np.add(COLORS[name], k * rng.uniform(-jitter.shade, jitter.shade, 3)), 0, 255)
    )
    bg = shade(scene.background)
    gradient = tuple(rng.uniform(-jitter.gradient, jitter.gradient, 3))
    gradient_dir = float(rng.uniform(0.0, 2.0 * math.pi))
    amplitude = rng.uniform(0.0, jitter.texture) / _TEXTURE_WAVES
    waves = tuple(
        (float(amplitude), *map(float, rng.uniform(-3.0, 3.0, 2)), float(rng.uniform(0.0, 2.0 * math.pi)))
        for _ in range(_TEXTURE_WAVES)
    )
    g = float(strength)
    objects = []
    for o in scene.objects:
        r = float(rng.uniform(*(jitter.small if o.size == "small" else jitter.large)))
        turn = jitter.rotation_deg[o.shape]
        angle = float(rng.uniform(-turn, turn)) if turn else 0.0
        ey, ex = shape_extent(o.shape, r, angle)
        fit = (0.5 - jitter.margin) / max(ey, ex, 1e-9)
        if fit < 1.0:  # a large triangle turned corner-up: shrink it into its cell (it stays in its class)
            r, ey, ex = r * fit, ey * fit, ex * fit
        room_y, room_x = max(0.0, 0.5 - jitter.margin - ey), max(0.0, 0.5 - jitter.margin - ex)
        dy, dx = float(rng.uniform(-room_y, room_y)), float(rng.uniform(-room_x, room_x))
        # The fixed rendering: centered, r = SIZE_EXTENT, upright; a triangle turns about its circumcenter,
        # which sits _TRI_C r below the point the fixed rendering centers.
        r0 = SIZE_EXTENT[o.size]
        dy0 = _TRI_C * r0 if o.shape == "triangle" else 0.0
        geometry = (dy0 + g * (dy - dy0), g * dx, r0 + g * (r - r0), g * angle)
        objects.append(ObjectStyle(*geometry, shade(o.color, g)))
    return Style(bg, gradient, gradient_dir, waves, tuple(objects))


def render_background(style: Style, image_size: int) -> np.ndarray:
    """The background of a jittered scene: float32 [S, S, 3] in 0..255 (shade + gradient + texture)."""
    t = (np.arange(image_size, dtype=np.float64) + 0.5) / image_size  # pixel centers in [0, 1)
    y, x = t[:, None], t[None, :]
    c, s = math.cos(style.gradient_dir), math.sin(style.gradient_dir)
    along = ((y - 0.5) * c + (x - 0.5) * s) / (0.5 * (abs(c) + abs(s)))  # -1 .. 1 across the image
    tex = sum(a * np.sin(2.0 * math.pi * (fy * y + fx * x) + ph) for a, fy, fx, ph in style.waves)
    bg = np.asarray(style.rgb) + along[..., None] * np.asarray(style.gradient) + np.asarray(tex)[..., None]
    return bg.astype(np.float32)


def render_jittered(scene: Scene, style: Style, image_size: int) -> np.ndarray:
    """Draws `scene` the way `style` says, anti-aliased; returns uint8 [image_size, image_size, 3]."""
    img = render_background(style, image_size)
    cw = image_size / GRID
    for o, st in zip(scene.objects, style.objects, strict=True):
        cy, cx = (o.row + 0.5 + st.dy) * cw, (o.col + 0.5 + st.dx) * cw
        r = st.r * cw
        reach = 1.2 * r + 1.0  # every shape lies within 1.17 r of its turning center
        y0, y1 = max(0, math.floor(cy - reach)), min(image_size, math.ceil(cy + reach))
        x0, x1 = max(0, math.floor(cx - reach)), min(image_size, math.ceil(cx + reach))
        dy = (np.arange(y0, y1, dtype=np.float32) + 0.5 - cy)[:, None]
        dx = (np.arange(x0, x1, dtype=np.float32) + 0.5 - cx)[None, :]
        cov = shape_coverage(o.shape, dy, dx, r, st.angle).astype(np.float32)
        patch = img[y0:y1, x0:x1]
        patch += cov[..., None] * (np.asarray(st.rgb, np.float32) - patch)
    return np.rint(np.clip(img, 0.0, 255.0)).astype(np.uint8)
