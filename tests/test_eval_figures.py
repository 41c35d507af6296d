"""figures.py's tables draw their images from the dataset the command line names (a benchmark size's data)."""

import numpy as np
import pytest

from reve_jax.speedup import figures


class _Drawn(Exception):
    pass


@pytest.mark.parametrize("figure", ["reader", "controls", "kid"])
def test_every_table_draws_from_the_dataset_options_given(monkeypatch, figure):
    seen = {}

    def spy(size, n, **data):
        seen.update(data)
        raise _Drawn

    monkeypatch.setattr(figures, "heldout", spy)
    argv = [figure, "--sizes", "32", "--n", "4", "--max-objects", "1", "--render", "fixed"]
    argv += ["--colors", "red, green,blue", "--shapes", "circle,square"]
    with pytest.raises(_Drawn):
        figures.main(argv)
    assert seen == dict(max_objects=1, render="fixed", shapes=("circle", "square"), colors=("red", "green", "blue"))


def test_heldout_restricts_the_vocabulary_and_the_rendering():
    colors, shapes = ("red", "green", "blue", "white"), ("circle", "square", "triangle")
    ds, index, _, scenes = figures.heldout(32, 64, 1, "fixed", shapes=shapes, colors=colors)
    assert {s.background for s in scenes} <= set(colors)
    assert {o.shape for s in scenes for o in s.objects} <= set(shapes)
    assert {o.color for s in scenes for o in s.objects} <= set(colors)
    assert all(len(s.objects) == 1 for s in scenes)
    # the fixed rendering draws one image per caption: the same scene drawn again is the same image
    np.testing.assert_array_equal(ds[int(index[0])]["image"], ds.image(int(index[0]), variant=1))
