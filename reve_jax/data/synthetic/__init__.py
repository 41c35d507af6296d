"""Procedural captioned shapes: a text-to-image dataset that needs no download.

Each sample is a background with `min_objects` to `max_objects` shapes, each in its own cell of a 3x3 grid, and a
caption that states every attribute, e.g. "a small red circle at the top left and a large blue square in the
center, on a white background". Sample `index` is drawn from `np.random.default_rng([seed, index])`, so any
index can be read at any time, in any order, by any process, and always gives the same scene.

Two renderings of a scene (`render`):

- "jitter" (the default): the caption fixes a distribution of images, not one image. What it does not state
  varies (`Style`, drawn after the scene from the same generator): each object's position within its named cell,
  its size within its size class, its rotation where the shape shows one (a circle has none; squares, diamonds
  and crosses turn by at most 15 degrees, so a square never becomes a diamond; triangles turn freely), its shade
  within its named color, and the background's shade, a smooth linear gradient and a light texture. Every stated
  attribute stays readable from the pixels: objects stay inside their cells, the size classes do not overlap, and
  every shade stays nearer its own palette color than any other (`JITTER` bounds it all).
- "fixed": every image is a deterministic function of its caption (plain background, objects centered in their
  cells at two exact sizes). Bit-for-bit the rendering of earlier versions, for reproducing old runs.

The structured `Scene` is kept beside the caption so a benchmark can check generated pixels against it
(`object_coverage` and `cell_center` give the geometry of the fixed rendering; `Style` that of a jittered one).
"""

from reve_jax.data.synthetic.dataset import SyntheticShapes
from reve_jax.data.synthetic.grammar import (
    CELL_PHRASES,
    COLOR_NAMES,
    COLORS,
    GRID,
    OMITTABLE,
    SHAPES,
    SIZE_EXTENT,
    SIZES,
    Scene,
    SceneObject,
    caption_of,
    longest_caption,
    parse_caption,
)
from reve_jax.data.synthetic.render import (
    JITTER,
    RENDERS,
    cell_center,
    geometry_strength,
    object_coverage,
    render_jittered,
    render_scene,
    sample_style,
    shape_coverage,
    shape_extent,
)

__all__ = [
    "CELL_PHRASES",
    "COLORS",
    "COLOR_NAMES",
    "GRID",
    "JITTER",
    "OMITTABLE",
    "RENDERS",
    "SHAPES",
    "SIZES",
    "SIZE_EXTENT",
    "Scene",
    "SceneObject",
    "SyntheticShapes",
    "caption_of",
    "cell_center",
    "geometry_strength",
    "longest_caption",
    "object_coverage",
    "parse_caption",
    "render_jittered",
    "render_scene",
    "sample_style",
    "shape_coverage",
    "shape_extent",
]
