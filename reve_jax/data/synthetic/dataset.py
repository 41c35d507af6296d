"""`SyntheticShapes`: random access to the synthetic dataset's samples (scene, caption, image) by index."""

import numpy as np

from reve_jax.data.synthetic.grammar import COLOR_NAMES, GRID, OMITTABLE, SHAPES, Scene, caption_of, sample_scene
from reve_jax.data.synthetic.render import (
    RENDERS,
    Style,
    geometry_strength,
    render_jittered,
    render_scene,
    sample_style,
)
from reve_jax.data.synthetic.split import NONE, SPLIT_TAGS, SPLITS, Compositions

_KEY_CAPTION = 1003  # the key tag of a training caption's left-out words (controls.py uses 1001 and 1002)
_KEY_SHIFT = 1004  # the key tag of a training image's object offsets (`shift`)


class SyntheticShapes:
    """Random-access captioned shapes. `ds[i]` -> dict(image=uint8 [S,S,3], caption=str, description=Scene).

    Args:
      image_size: side S of the square images in pixels (any size from 9 up; 16 to 512 are the tested ones).
      num_samples: length of the index space.
      seed: content seed; sample i depends only on (seed, i).
      max_objects, min_objects: each image has between min_objects and max_objects objects (1..9).
      shapes, colors: the shapes and the palette (background and object colors, at least 2) scenes draw from;
        () = all of SHAPES / COLOR_NAMES (the same scenes as earlier versions).
      render: "jitter" (a distribution of images per caption) or "fixed" (one image per caption); see the module
        docstring. The captions do not depend on it.
      heldout: the compositions the training split never shows (split.py; default: none);
      split: "train" (no held-out composition), "unseen" (at least one) or "seen" (training-like scenes from a
        stream the training never reads); see split.py. With no held-out compositions "train" is every scene, as in
        earlier versions.
      caption_drop: in the train split, the probability that a caption leaves out each object's size, color, shape
        or position word (each apart, drawn from the sample's key; the image still shows it), so that each word is
        also learned without the others. Evaluation splits state every attribute. 0 (the default): every caption
        states everything, as in earlier versions.
      shift: in the train split of the fixed rendering, the largest distance in pixels, along each axis apart, that
        an object's center moves from its cell's center (uniform, drawn from the sample's key; the caption still
        holds: up to 1.5 px at 32 px the reader reads every object in its cell, tests/test_data.py), so that each
        shape is seen at every sub-pixel and sub-patch position. Evaluation splits draw objects centered. 0 (the
        default): one image per caption.
    """

    def __init__(
        self,
        image_size: int = 32,
        num_samples: int = 1_000_000,
        seed: int = 0,
        max_objects: int = 3,
        *,
        min_objects: int = 1,
        shapes: tuple[str, ...] = (),
        colors: tuple[str, ...] = (),
        render: str = "jitter",
        heldout: Compositions = NONE,
        split: str = "train",
        caption_drop: float = 0.0,
        shift: float = 0.0,
    ):
        if image_size < 9:
            raise ValueError(f"data.image_size={image_size}: need at least 9 pixels (3 per grid cell)")
        if num_samples < 1:
            raise ValueError(f"data.num_samples={num_samples}: need at least 1")
        if seed < 0:
            raise ValueError(f"data.seed={seed}: must be >= 0")
        if not 1 <= max_objects <= GRID * GRID:
            raise ValueError(f"data.max_objects={max_objects}: must be in [1, {GRID * GRID}]")
        if not 1 <= min_objects <= max_objects:
            raise ValueError(f"data.min_objects={min_objects}: must be in [1, data.max_objects={max_objects}]")
        shapes, colors = tuple(shapes) or SHAPES, tuple(colors) or COLOR_NAMES
        if not set(shapes) <= set(SHAPES) or len(set(shapes)) != len(shapes):
            raise ValueError(f"data.shapes={shapes}: distinct names from {SHAPES}")
        if not set(colors) <= set(COLOR_NAMES) or len(set(colors)) != len(colors) or len(colors) < 2:
            raise ValueError(f"data.colors={colors}: at least 2 distinct names from {COLOR_NAMES}")
        if not 0.0 <= caption_drop < 1.0:
            raise ValueError(f"data.caption_drop={caption_drop}: a probability in [0, 1) (0 states every attribute)")
        if render not in RENDERS:
            raise ValueError(f"data.render={render!r}: choose one of {RENDERS}")
        if shift < 0 or (shift and render != "fixed"):
            raise ValueError(
                f"data.shift={shift}: pixels >= 0, for the fixed rendering (the jitter rendering moves objects "
                "within their cells already): set data.shift=0 or data.render='fixed'"
            )
        self.image_size = int(image_size)
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.max_objects, self.min_objects = int(max_objects), int(min_objects)
        self.shapes, self.colors, self.render = shapes, colors, render
        self.strength = geometry_strength(self.image_size)
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: choose one of {SPLITS}")
        if split == "unseen" and not heldout:
            raise ValueError(
                "the unseen split needs held-out compositions, and this dataset holds none (data.heldout_frac=0, or "
                "a run that trained on every composition): score the seen split instead"
            )
        self.heldout, self.split = heldout, split
        self.caption_drop = float(caption_drop)
        self._drop = self.caption_drop if split == "train" else 0.0  # evaluation captions state everything
        self.shift = float(shift)
        self._shift = self.shift if split == "train" else 0.0  # evaluation images are drawn centered
        self._tag = (SPLIT_TAGS[split],) if split in SPLIT_TAGS else ()

    def with_split(self, split: str) -> "SyntheticShapes":
        """The same dataset (size, palette, rendering, held-out compositions) drawn from another split."""
        return SyntheticShapes(
            self.image_size, self.num_samples, self.seed, self.max_objects, min_objects=self.min_objects,
            shapes=self.shapes, colors=self.colors, render=self.render, heldout=self.heldout, split=split,
            caption_drop=self.caption_drop, shift=self.shift,
        )  # fmt: skip

    def key(self, index: int, *extra: int) -> list[int]:
        """The random key of sample `index` (and of `extra` draws for it: another image of its caption, a control's
        variation) in this split: [seed, index, *extra], with the split's tag last for the evaluation splits, so
        that no two splits ever share a draw."""
        return [self.seed, int(index), *map(int, extra), *self._tag]

    def __len__(self) -> int:
        return self.num_samples

    def _check_index(self, index: int) -> int:
        i = int(index)
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {i} out of range [0, {self.num_samples})")
        return i

    def _draw(self, index: int) -> tuple[Scene, np.random.Generator]:
        rng = np.random.default_rng(self.key(self._check_index(index)))
        scene = self._scene(rng)
        if self.heldout:  # draw again from the same stream until the scene belongs to the split
            want = self.split == "unseen"
            while self.heldout.in_scene(scene) != want:
                scene = self._scene(rng)
        return scene, rng

    def _scene(self, rng: np.random.Generator) -> Scene:
        return sample_scene(rng, self.max_objects, self.min_objects, self.shapes, self.colors)

    def scene(self, index: int) -> Scene:
        """The Scene of sample `index` (cheap: no rendering)."""
        return self._draw(index)[0]

    def caption(self, index: int) -> str:
        """The caption of sample `index` (cheap: no rendering)."""
        return self._caption(index, self.scene(index))

    def _caption(self, index: int, scene: Scene) -> str:
        if not self._drop:
            return caption_of(scene)
        rng = np.random.default_rng(self.key(index, _KEY_CAPTION))
        drop = rng.random((len(scene.objects), len(OMITTABLE))) < self._drop
        omit = tuple(frozenset(a for a, d in zip(OMITTABLE, row, strict=True) if d) for row in drop)
        return caption_of(scene, omit)

    def _offsets(self, index: int, scene: Scene, variant: int = 0) -> np.ndarray | None:
        """Each object's (dy, dx) offset in pixels in a train-split image with `shift` (None: centered)."""
        if not self._shift:
            return None
        rng = np.random.default_rng(self.key(index, _KEY_SHIFT, *([variant] if variant else [])))
        return rng.uniform(-self._shift, self._shift, (len(scene.objects), 2))

    def style(self, index: int, variant: int = 0) -> Style | None:
        """How sample `index` is drawn (None for the fixed rendering); variant > 0: another draw for its caption."""
        if self.render == "fixed":
            return None
        scene, rng = self._draw(index)
        if variant:
            rng = np.random.default_rng(self.key(index, variant))
        return sample_style(rng, scene, strength=self.strength)

    def draw(self, scene: Scene, style_key: tuple[int, ...]) -> np.ndarray:
        """Any `scene` (e.g. one a test or a control changed) in this dataset's rendering, its variation drawn from
        `np.random.default_rng(style_key)`: uint8 [S, S, 3]."""
        if self.render == "fixed":
            return render_scene(scene, self.image_size)
        style = sample_style(np.random.default_rng(style_key), scene, strength=self.strength)
        return render_jittered(scene, style, self.image_size)

    def image(self, index: int, variant: int = 0) -> np.ndarray:
        """The image of sample `index`; variant > 0 draws another image of the same caption (the fixed rendering
        has one, or more with `shift`). uint8 [S, S, 3]."""
        scene = self.scene(index)
        if self.render == "fixed":
            return render_scene(scene, self.image_size, self._offsets(index, scene, variant))
        return render_jittered(scene, self.style(index, variant), self.image_size)

    def __getitem__(self, index: int) -> dict:
        scene, rng = self._draw(index)
        if self.render == "fixed":
            image = render_scene(scene, self.image_size, self._offsets(index, scene))
        else:
            image = render_jittered(scene, sample_style(rng, scene, strength=self.strength), self.image_size)
        return {"image": image, "caption": self._caption(index, scene), "description": scene}
