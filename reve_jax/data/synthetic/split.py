"""Compositions held out of training: a seeded set of (color, shape) and (shape, cell) pairs that the training
stream never shows, so that evaluation can ask for something the model never saw.

With one object per image the caption space is small (5,040 one-object captions against the 64,000 samples of the
README's run), so a model sees every caption many times and scoring "the last indices of the dataset" measures fit.
Holding out compositions is what makes a held-out caption exist at all: every color, shape and cell is still seen,
each in other combinations, but a held-out pair (a red circle; a triangle at the top left) never is. The split
depends on its own seed and the palette, never on the run's seed, steps or process count.

Three splits of `SyntheticShapes` (dataset.py) draw from disjoint random streams of the same index space:
- "train": scenes with no object of a held-out composition (a scene that has one is drawn again);
- "unseen": scenes with at least one object of a held-out composition: generalization;
- "seen": scenes like the training ones, from a stream the training never reads (their captions may well be
  training captions: this measures fit, and is reported beside "unseen").
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

SPLITS = ("train", "unseen", "seen")
# The last element of an evaluation split's random keys; a training key never has it (dataset.py).
SPLIT_TAGS = {"unseen": 1_000_001, "seen": 1_000_002}


@dataclasses.dataclass(frozen=True)
class Compositions:
    """The held-out pairs: object (color, shape) and (shape, cell)."""

    color_shape: frozenset[tuple[str, str]] = frozenset()
    shape_cell: frozenset[tuple[str, int]] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.color_shape or self.shape_cell)

    def holds(self, obj) -> bool:
        """Whether an object (grammar.SceneObject) has a held-out composition."""
        return (obj.color, obj.shape) in self.color_shape or (obj.shape, obj.cell) in self.shape_cell

    def in_scene(self, scene) -> bool:
        return any(self.holds(o) for o in scene.objects)

    def kinds(self, scene) -> str:
        """Which held-out pairs a scene holds: "color-shape", "shape-cell", "both" or "none"."""
        cs = any((o.color, o.shape) in self.color_shape for o in scene.objects)
        sc = any((o.shape, o.cell) in self.shape_cell for o in scene.objects)
        return {(True, True): "both", (True, False): "color-shape", (False, True): "shape-cell"}.get((cs, sc), "none")

    def describe(self) -> str:
        cs = ", ".join(f"{c} {s}" for c, s in sorted(self.color_shape))
        sc = ", ".join(f"{s} in cell {c}" for s, c in sorted(self.shape_cell))
        return f"held out: {cs or 'no color-shape pair'}; {sc or 'no shape-cell pair'}"


NONE = Compositions()  # every composition is trained on


def _pick(rng: np.random.Generator, rows: tuple, cols: tuple, frac: float) -> frozenset:
    """round(frac x len(rows) x len(cols)) pairs (at least one when frac > 0), drawn in a seeded order and spread
    out: a row holds at most ceil(frac x len(cols)) of them and a column ceil(frac x len(rows)), and every row and
    column keeps at least one pair outside the set (every color, shape and cell stays seen)."""
    pairs = [(r, c) for r in rows for c in cols]
    want = max(1, round(frac * len(pairs))) if frac > 0 else 0
    row_cap, col_cap = math.ceil(frac * len(cols)), math.ceil(frac * len(rows))
    held: set = set()
    for k in rng.permutation(len(pairs)):
        if len(held) == want:
            break
        r, c = pairs[int(k)]
        in_row, in_col = sum(p[0] == r for p in held), sum(p[1] == c for p in held)
        if in_row < min(row_cap, len(cols) - 1) and in_col < min(col_cap, len(rows) - 1):
            held.add((r, c))
    return frozenset(held)


def held_out(frac: float, seed: int, colors: tuple[str, ...], shapes: tuple[str, ...], cells: int) -> Compositions:
    """The held-out compositions of a palette: `frac` of its (color, shape) pairs and of its (shape, cell) pairs,
    chosen by `seed` alone. frac = 0: none (every composition is trained on)."""
    if not 0 <= frac < 0.5 or math.isnan(frac):
        raise ValueError(f"data.heldout_frac={frac}: must be in [0, 0.5) (0: hold nothing out)")
    rng = np.random.default_rng([int(seed), 7])
    color_shape = _pick(rng, tuple(colors), tuple(shapes), frac)
    shape_cell = _pick(rng, tuple(shapes), tuple(range(cells)), frac)
    return Compositions(color_shape, shape_cell)
