"""Procedural captioned shapes: a text-to-image dataset that needs no download.

Each sample is a solid background with 1 to `max_objects` shapes, each in its own cell of a 3x3 grid, and a
caption that states every attribute, e.g. "a small red circle at the top left and a large blue square in the
center, on a white background". Sample `index` is drawn from `np.random.default_rng([seed, index])`, so any
index can be read at any time, in any order, by any process, and always gives the same scene.

The structured `Scene` is kept beside the caption so a benchmark can check generated pixels against it
(`object_coverage` and `cell_center` give the geometry it was drawn with).
"""

import dataclasses
import math
import re
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

# Well separated sRGB colors; a single name each so captions stay one word per attribute.
COLORS: Mapping[str, tuple[int, int, int]] = MappingProxyType(
    {
        "red": (220, 30, 30),
        "green": (30, 170, 50),
        "blue": (30, 70, 230),
        "yellow": (245, 220, 30),
        "purple": (140, 50, 190),
        "orange": (250, 140, 20),
        "white": (245, 245, 245),
        "black": (15, 15, 15),
    }
)
COLOR_NAMES: tuple[str, ...] = tuple(COLORS)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "cross")
SIZES: tuple[str, ...] = ("small", "large")
# Half-extent of an object as a fraction of the grid cell width: a large object nearly fills its cell, a small
# one about half of it, and neither reaches the neighbouring cell (so objects never overlap).
SIZE_EXTENT: Mapping[str, float] = MappingProxyType({"small": 0.24, "large": 0.42})
# Cells are numbered row-major, 0 = top left ... 8 = bottom right.
CELL_NAMES: tuple[str, ...] = (
    "top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right",
)  # fmt: skip
CELL_PHRASES: tuple[str, ...] = (
    "at the top left", "at the top", "at the top right",
    "on the left", "in the center", "on the right",
    "at the bottom left", "at the bottom", "at the bottom right",
)  # fmt: skip
GRID = 3


@dataclasses.dataclass(frozen=True)
class SceneObject:
    """One shape: `shape` in SHAPES, `color` in COLOR_NAMES, `size` in SIZES, `cell` in [0, 9) row-major."""

    shape: str
    color: str
    size: str
    cell: int

    @property
    def row(self) -> int:
        return self.cell // GRID

    @property
    def col(self) -> int:
        return self.cell % GRID

    @property
    def position(self) -> str:
        """The cell's name, e.g. "top left"."""
        return CELL_NAMES[self.cell]


@dataclasses.dataclass(frozen=True)
class Scene:
    """What one image shows: the background color name and the objects in caption order."""

    background: str
    objects: tuple[SceneObject, ...]

    def to_dict(self) -> dict:
        """JSON-ready: {"background": str, "objects": [{"shape", "color", "size", "cell", "position"}]}."""
        objs = [dict(dataclasses.asdict(o), position=o.position) for o in self.objects]
        return {"background": self.background, "objects": objs}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Scene":
        """Inverse of `to_dict` (the redundant "position" key is ignored)."""
        objs = tuple(SceneObject(o["shape"], o["color"], o["size"], int(o["cell"])) for o in d["objects"])
        return cls(d["background"], objs)


def sample_scene(rng: np.random.Generator, max_objects: int) -> Scene:
    """Draws a scene: 1..max_objects objects in distinct cells, none with the background's color."""
    n = int(rng.integers(1, max_objects + 1))
    bg = int(rng.integers(len(COLOR_NAMES)))
    cells = rng.choice(GRID * GRID, size=n, replace=False)
    objects = []
    for cell in cells:
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        size = SIZES[int(rng.integers(len(SIZES)))]
        c = int(rng.integers(len(COLOR_NAMES) - 1))
        color = COLOR_NAMES[c + (c >= bg)]  # skip the background color without rejection sampling
        objects.append(SceneObject(shape, color, size, int(cell)))
    return Scene(COLOR_NAMES[bg], tuple(objects))


def caption_of(scene: Scene) -> str:
    """The caption stating every attribute: objects as "x, y and z", then ", on a(n) <bg> background"."""
    parts = [f"a {o.size} {o.color} {o.shape} {CELL_PHRASES[o.cell]}" for o in scene.objects]
    body = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    article = "an" if scene.background[0] in "aeiou" else "a"
    return f"{body}, on {article} {scene.background} background"


_BACKGROUND_RE = re.compile(r", on an? (?P<color>\w+) background$")
_OBJECT_RE = re.compile(
    r"a (?P<size>\w+) (?P<color>\w+) (?P<shape>\w+) (?P<phrase>(?:at|on|in) the [a-z ]+?)(?=, | and |$)"
)


def parse_caption(caption: str) -> Scene:
    """Inverse of `caption_of`. Returns the Scene; raises ValueError for text outside the caption grammar."""
    m = _BACKGROUND_RE.search(caption)
    if m is None:
        raise ValueError(f"not a synthetic caption (no background clause): {caption!r}")
    body, background = caption[: m.start()], m["color"]
    objects, pos = [], 0
    while pos < len(body):
        m = _OBJECT_RE.match(body, pos)
        if m is None or m["phrase"] not in CELL_PHRASES:
            raise ValueError(f"not a synthetic caption (at character {pos}): {caption!r}")
        cell = CELL_PHRASES.index(m["phrase"])
        objects.append(SceneObject(m["shape"], m["color"], m["size"], cell))
        pos = m.end()
        for joiner in (", ", " and "):
            if body.startswith(joiner, pos):
                pos += len(joiner)
                break
    scene = Scene(background, tuple(objects))
    _check_scene(scene)
    return scene


def _check_scene(scene: Scene) -> None:
    if scene.background not in COLORS:
        raise ValueError(f"unknown background color {scene.background!r}; known: {COLOR_NAMES}")
    if not scene.objects:
        raise ValueError("a scene needs at least one object")
    for o in scene.objects:
        if o.shape not in SHAPES or o.color not in COLORS or o.size not in SIZES or not 0 <= o.cell < 9:
            raise ValueError(f"invalid object {o}")
    if len({o.cell for o in scene.objects}) != len(scene.objects):
        raise ValueError("objects must be in distinct cells")


def longest_caption(max_objects: int) -> str:
    """A caption with the most words any scene of up to `max_objects` objects can produce."""
    # Two-word cell names ("top left") give the longest phrases; fill those cells first.
    cells = sorted(range(GRID * GRID), key=lambda c: -len(CELL_PHRASES[c].split()))[:max_objects]
    objs = tuple(SceneObject("triangle", "purple", "small", c) for c in cells)
    return caption_of(Scene("yellow", objs))


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


def _coverage_patch(obj: SceneObject, image_size: int) -> tuple[int, int, np.ndarray]:
    """Coverage in [0, 1] of `obj` over the pixels of its bounding box: returns (y0, x0, coverage [h, w])."""
    cy, cx = cell_center(obj.cell, image_size)
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


def render_scene(scene: Scene, image_size: int) -> np.ndarray:
    """Draws `scene` anti-aliased; returns uint8 [image_size, image_size, 3]."""
    img = np.empty((image_size, image_size, 3), np.uint8)
    img[:] = COLORS[scene.background]
    # Blend in float only inside each object's box (the bulk of a large image is plain background).
    for obj in scene.objects:
        y0, x0, cov = _coverage_patch(obj, image_size)
        window = (slice(y0, y0 + cov.shape[0]), slice(x0, x0 + cov.shape[1]))
        patch = img[window].astype(np.float32)
        patch += cov[..., None] * (np.asarray(COLORS[obj.color], np.float32) - patch)
        img[window] = np.rint(patch).astype(np.uint8)
    return img


class SyntheticShapes:
    """Random-access captioned shapes. `ds[i]` -> dict(image=uint8 [S,S,3], caption=str, description=Scene).

    Args:
      image_size: side S of the square images in pixels (any size from 9 up; 32 to 512 are the tested ones).
      num_samples: length of the index space.
      seed: content seed; sample i depends only on (seed, i).
      max_objects: at most this many objects per image (1..9).
    """

    def __init__(self, image_size: int = 32, num_samples: int = 1_000_000, seed: int = 0, max_objects: int = 3):
        if image_size < 9:
            raise ValueError(f"data.image_size={image_size}: need at least 9 pixels (3 per grid cell)")
        if num_samples < 1:
            raise ValueError(f"data.num_samples={num_samples}: need at least 1")
        if seed < 0:
            raise ValueError(f"data.seed={seed}: must be >= 0")
        if not 1 <= max_objects <= GRID * GRID:
            raise ValueError(f"data.max_objects={max_objects}: must be in [1, {GRID * GRID}]")
        self.image_size = int(image_size)
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.max_objects = int(max_objects)

    def __len__(self) -> int:
        return self.num_samples

    def _check_index(self, index: int) -> int:
        i = int(index)
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {i} out of range [0, {self.num_samples})")
        return i

    def scene(self, index: int) -> Scene:
        """The Scene of sample `index` (cheap: no rendering)."""
        rng = np.random.default_rng([self.seed, self._check_index(index)])
        return sample_scene(rng, self.max_objects)

    def caption(self, index: int) -> str:
        """The caption of sample `index` (cheap: no rendering)."""
        return caption_of(self.scene(index))

    def __getitem__(self, index: int) -> dict:
        scene = self.scene(index)
        return {
            "image": render_scene(scene, self.image_size),
            "caption": caption_of(scene),
            "description": scene,
        }
