"""Built-in word-level tokenizer for the synthetic captions: fixed vocabulary, no files, deterministic.

Text is lower-cased and split into words (runs of letters/digits) and single punctuation marks. Each known
token maps to its position in VOCAB; anything else maps to UNK_ID. Id 0 is padding.

VOCAB is append-only: a token's id is part of every trained text embedding, so never reorder or remove
entries (tests check that every word a synthetic caption can produce is here).
"""

import re
from collections.abc import Sequence
from types import MappingProxyType

import numpy as np

PAD, UNK = "<pad>", "<unk>"
VOCAB: tuple[str, ...] = (
    PAD, UNK, ",", ".",
    # caption grammar
    "a", "an", "and", "the", "at", "on", "in", "background",
    # sizes
    "small", "large",
    # colors
    "red", "green", "blue", "yellow", "purple", "orange", "white", "black",
    # shapes
    "circle", "square", "triangle", "diamond", "cross",
    # positions
    "top", "bottom", "left", "right", "center",
)  # fmt: skip
PAD_ID, UNK_ID = 0, 1
VOCAB_SIZE = len(VOCAB)
_IDS = MappingProxyType({tok: i for i, tok in enumerate(VOCAB)})
_TOKEN_RE = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")
_NO_SPACE_BEFORE = frozenset(",.;:!?")


def tokenize(text: str) -> list[str]:
    """Splits `text` into lower-case word and punctuation tokens (strings, not yet ids)."""
    return _TOKEN_RE.findall(text.lower())


def encode(text: str, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns (ids int32 [max_len], mask bool [max_len]): ids padded with PAD_ID, or truncated to max_len."""
    if max_len < 1:
        raise ValueError(f"max_len={max_len}: must be >= 1")
    toks = tokenize(text)[:max_len]
    ids = np.full((max_len,), PAD_ID, np.int32)
    ids[: len(toks)] = [_IDS.get(t, UNK_ID) for t in toks]
    mask = np.zeros((max_len,), bool)
    mask[: len(toks)] = True
    return ids, mask


def encode_batch(texts: Sequence[str], max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns (ids int32 [n, max_len], mask bool [n, max_len]) for n texts (e.g. sample-grid prompts)."""
    pairs = [encode(t, max_len) for t in texts]
    ids = np.stack([p[0] for p in pairs]) if pairs else np.zeros((0, max_len), np.int32)
    mask = np.stack([p[1] for p in pairs]) if pairs else np.zeros((0, max_len), bool)
    return ids, mask


def decode(ids: Sequence[int] | np.ndarray, mask: Sequence[bool] | np.ndarray | None = None) -> str:
    """Inverse of `encode` for in-vocabulary text: joins tokens with spaces, punctuation attached to the left.

    Padding (PAD_ID, or positions where `mask` is False) is skipped; unknown ids decode to "<unk>".
    """
    ids = np.asarray(ids).reshape(-1)
    keep = ids != PAD_ID if mask is None else np.asarray(mask, bool).reshape(-1)
    out: list[str] = []
    for i in ids[keep]:
        tok = VOCAB[int(i)] if 0 <= int(i) < VOCAB_SIZE else UNK
        if out and tok not in _NO_SPACE_BEFORE:
            out.append(" ")
        out.append(tok)
    return "".join(out)


def num_tokens(text: str) -> int:
    """How many tokens `text` encodes to before padding or truncation."""
    return len(tokenize(text))
