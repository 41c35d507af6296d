"""What every frozen text encoder gives data preparation: per-token embeddings with a prefix mask."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class Encoded:
    """Encoded captions: `emb` f32 [n, L, D] (zero past each caption's length), `mask` bool [n, L] (True on a
    prefix: padding is at the end), `truncated` bool [n] (the caption had more than L tokens)."""

    emb: np.ndarray
    mask: np.ndarray
    truncated: np.ndarray


class TextEncoder(Protocol):
    """A frozen encoder run at preparation time. `name` and `dim` go into the shard manifest; `max_len` is L."""

    name: str
    dim: int
    max_len: int

    def encode(self, texts: Sequence[str]) -> Encoded:
        """Encodes `texts` (a list of n captions) into an `Encoded` of n rows."""
        ...


def pad_ids(rows: Sequence[Sequence[int]], max_len: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists -> (ids int32 [n, max_len] padded at the end with `pad_id`, mask bool [n, max_len]).
    Rows longer than max_len are cut."""
    ids = np.full((len(rows), max_len), pad_id, np.int32)
    mask = np.zeros((len(rows), max_len), bool)
    for i, row in enumerate(rows):
        row = list(row)[:max_len]
        ids[i, : len(row)] = row
        mask[i, : len(row)] = True
    return ids, mask


def missing_weights_error(path, what: str, fix: str) -> FileNotFoundError:
    """The error raised when an encoder's files are not where they should be: names the path and the fix."""
    return FileNotFoundError(f"{what} not found at {str(path)!r}. {fix}")
