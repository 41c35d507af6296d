"""Control image sets that every evaluation reports beside a model's score: what real images score (the ceiling),
and what wrong images score (each must land clearly below real images on every metric that reads what is wrong
with it, or the metric cannot tell them apart from a model that learned the captions):

- real: another real image for each held-out caption (the dataset's next draw of its variation; the fixed
  rendering has only one image per caption, so there it is the held-out image itself). Its distance to the
  held-out images is the real-vs-real floor;
- shuffled: real images under the wrong captions: the images of the samples just before the held-out ones (other
  captions, and no copy of a held-out image, which would pair with itself in the distances);
- background: each caption's background alone, drawn the dataset's way, without objects;
- one_object: one object of the caption, right in color, shape and size, in a random cell (any of the nine), and
  none of the others: the score of a model that draws the right thing anywhere;
- noisy: the real images with Gaussian pixel noise of std NOISY_STD in [-1, 1] (about 6 levels of 255), a degraded
  image: the right scene under the grain a model can leave in flat regions. The caption checks read it right (they
  read scenes, not texture); the distances must put it clearly above the floor.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from reve_jax.data.synthetic import dataset, grammar

NAMES = ("real", "shuffled", "background", "one_object", "noisy")
NOISY_STD = 0.05
_KEY_BACKGROUND, _KEY_ONE_OBJECT = 1001, 1002  # style-key tags: the controls' variation is drawn apart from the data's


def control_images(ds: dataset.SyntheticShapes, index, seed: int) -> dict[str, np.ndarray]:
    """The control sets for the held-out samples `index` of `ds`: name -> uint8 [n, S, S, 3], row i for caption i
    (see the module docstring); `seed` draws the single objects' cells."""
    index = [int(i) for i in index]
    rng = np.random.default_rng(seed)
    out = {"real": real_images(ds, index)}
    others = [(min(index) - 1 - k) % ds.num_samples for k in range(len(index))]
    out["shuffled"] = np.stack([ds[i]["image"] for i in others])
    out["background"] = backgrounds(ds, index)
    one = []
    for i in index:
        scene = ds.scene(i)
        moved = dataclasses.replace(scene.objects[0], cell=int(rng.integers(grammar.GRID**2)))
        one.append(ds.draw(grammar.Scene(scene.background, (moved,)), ds.key(i, _KEY_ONE_OBJECT)))
    out["one_object"] = np.stack(one)
    noise = NOISY_STD * 127.5 * rng.standard_normal(out["real"].shape)  # the std in [-1, 1], in uint8 levels
    out["noisy"] = np.rint(out["real"] + noise).clip(0, 255).astype(np.uint8)
    return out


def real_images(ds: dataset.SyntheticShapes, index) -> np.ndarray:
    """The `real` control alone: another real image for each caption, uint8 [n, S, S, 3] (the real-vs-real floor)."""
    return np.stack([ds.image(int(i), variant=1) for i in index])


def backgrounds(ds: dataset.SyntheticShapes, index) -> np.ndarray:
    """Each caption's background alone, drawn the dataset's way, without objects: uint8 [n, S, S, 3] (in the fixed
    rendering, the caption's image with its objects taken out)."""
    out = []
    for i in (int(i) for i in index):
        out.append(ds.draw(grammar.Scene(ds.scene(i).background, ()), ds.key(i, _KEY_BACKGROUND)))
    return np.stack(out)
