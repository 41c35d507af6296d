"""The caption grammar of the synthetic dataset: the vocabulary (colors, shapes, sizes, grid cells), scenes,
their captions and the parser that reads a caption back into its scene."""

import dataclasses
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


def sample_scene(
    rng: np.random.Generator,
    max_objects: int,
    min_objects: int = 1,
    shapes: tuple[str, ...] = SHAPES,
    colors: tuple[str, ...] = COLOR_NAMES,
) -> Scene:
    """Draws a scene: min_objects..max_objects objects in distinct cells, shapes from `shapes`, the background and
    object colors from `colors`, no object with the background's color. With the default shapes and colors the
    draws are those of earlier versions (same scenes for the same generator)."""
    n = int(rng.integers(min_objects, max_objects + 1))
    bg = int(rng.integers(len(colors)))
    cells = rng.choice(GRID * GRID, size=n, replace=False)
    objects = []
    for cell in cells:
        shape = shapes[int(rng.integers(len(shapes)))]
        size = SIZES[int(rng.integers(len(SIZES)))]
        c = int(rng.integers(len(colors) - 1))
        color = colors[c + (c >= bg)]  # skip the background color without rejection sampling
        objects.append(SceneObject(shape, color, size, int(cell)))
    return Scene(colors[bg], tuple(objects))


# The object words a training caption may leave out (`SyntheticShapes(caption_drop=...)`), in caption order.
OMITTABLE: tuple[str, ...] = ("size", "color", "shape", "position")


def caption_of(scene: Scene, omit: tuple[frozenset[str], ...] = ()) -> str:
    """The caption stating every attribute: objects as "x, y and z", then ", on a(n) <bg> background".

    `omit`: per object, the attributes (names from OMITTABLE) its phrase leaves out, e.g. "a small circle at the top
    left" without its color; () states every attribute. Only training captions leave words out; evaluation
    captions, and every caption `parse_caption` reads, state them all.
    """
    parts = [_phrase(o, omit[k] if omit else frozenset()) for k, o in enumerate(scene.objects)]
    body = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    article = "an" if scene.background[0] in "aeiou" else "a"
    return f"{body}, on {article} {scene.background} background"


def _phrase(o: SceneObject, omit: frozenset[str]) -> str:
    unknown = set(omit) - set(OMITTABLE)
    if unknown:
        raise ValueError(f"cannot leave out {sorted(unknown)} of an object phrase; choose from {OMITTABLE}")
    words = {"size": o.size, "color": o.color, "shape": o.shape, "position": CELL_PHRASES[o.cell]}
    return " ".join(["a", *(words[a] for a in OMITTABLE if a not in omit)])


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
