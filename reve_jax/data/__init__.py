"""Data: the procedural captioned-shapes dataset, its tokenizer and the Grain input pipeline."""

from reve_jax.data.pipeline import (
    GlobalOrder,
    captions_of,
    dataset_from_config,
    local_positions,
    make_batch_iterator,
)
from reve_jax.data.synthetic import Scene, SceneObject, SyntheticShapes

__all__ = [
    "GlobalOrder",
    "Scene",
    "SceneObject",
    "SyntheticShapes",
    "captions_of",
    "dataset_from_config",
    "local_positions",
    "make_batch_iterator",
]
