"""Prepared image-caption shards: the record format and the random-access source the pipeline reads.

A shard directory holds `shard-NNNNN.array_record` files (ArrayRecord, one record per image, group_size 1 for
fast random access), a `shard-NNNNN.json` sidecar per shard, and `manifest.json` (written last). Each record
is a msgpack map:

  key          str    where the image came from (relative path, tar/key, synthetic/i)
  caption      str
  image        bytes  the image at its final size, as `image_format`: raw (uint8 H*W*3, row-major RGB),
                      png or jpeg
  image_format str    raw | png | jpeg
  height,width int    final size in pixels
  bucket       int    index into manifest["buckets"], -1 without aspect buckets
  orig_size    [h, w] size of the source image
  text_emb     bytes  (only with a text encoder) the caption's valid tokens, `emb_dtype` [text_len, dim]
  text_len     int    valid tokens (the rest of max_len is padding, at the end)
  emb_dtype    str    float32 | float16

Within a shard, records are ordered by bucket, so the manifest's per-shard `bucket_counts` tell which global
indices belong to which bucket without reading any record.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

MANIFEST = "manifest.json"
FORMAT = "reve_jax.shards"
VERSION = 1
IMAGE_FORMATS = ("raw", "png", "jpeg")
EMB_DTYPES = ("float32", "float16")


def shard_name(i: int) -> str:
    """File name of shard `i` (its sidecar is the same name with .json)."""
    return f"shard-{i:05d}.array_record"


def encode_image(image: np.ndarray, image_format: str, jpeg_quality: int = 95) -> bytes:
    """uint8 [H, W, 3] -> bytes in `image_format` (raw, png or jpeg)."""
    image = np.ascontiguousarray(image, np.uint8)
    if image_format == "raw":
        return image.tobytes()
    from PIL import Image

    buf = io.BytesIO()
    if image_format == "png":
        Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    elif image_format == "jpeg":
        Image.fromarray(image).save(buf, format="JPEG", quality=int(jpeg_quality))
    else:
        raise ValueError(f"image_format={image_format!r}; expected one of {IMAGE_FORMATS}")
    return buf.getvalue()


def decode_image(data: bytes, image_format: str, height: int, width: int) -> np.ndarray:
    """Inverse of `encode_image`: returns uint8 [height, width, 3] (read-only for raw)."""
    if image_format == "raw":
        return np.frombuffer(data, np.uint8).reshape(height, width, 3)
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def encode_record(
    key: str,
    caption: str,
    image: bytes,
    image_format: str,
    height: int,
    width: int,
    *,
    bucket: int = -1,
    orig_size: tuple[int, int] = (0, 0),
    text_emb: np.ndarray | None = None,
    emb_dtype: str = "float32",
) -> bytes:
    """One record's bytes. `image` is already encoded (see `encode_image`); `text_emb` [text_len, dim] holds
    only the caption's valid tokens."""
    rec: dict[str, Any] = {
        "key": key,
        "caption": caption,
        "image": image,
        "image_format": image_format,
        "height": int(height),
        "width": int(width),
        "bucket": int(bucket),
        "orig_size": [int(orig_size[0]), int(orig_size[1])],
    }
    if text_emb is not None:
        if emb_dtype not in EMB_DTYPES:
            raise ValueError(f"emb_dtype={emb_dtype!r}; expected one of {EMB_DTYPES}")
        emb = np.ascontiguousarray(text_emb, np.dtype(emb_dtype).newbyteorder("<"))
        rec.update(text_emb=emb.tobytes(), text_len=int(emb.shape[0]), emb_dtype=emb_dtype)
    return msgpack.packb(rec, use_bin_type=True)


def decode_record(data: bytes, emb_dim: int = 0, with_image: bool = True) -> dict[str, Any]:
    """Record bytes -> dict(key, caption, bucket, orig_size, image uint8 [H, W, 3] if `with_image`, and
    text_emb f32 [text_len, emb_dim] when the record has embeddings)."""
    rec = msgpack.unpackb(data, raw=False)
    out = {k: rec[k] for k in ("key", "caption", "bucket", "orig_size")}
    if with_image:
        out["image"] = decode_image(rec["image"], rec["image_format"], rec["height"], rec["width"])
    if "text_emb" in rec:
        dtype = np.dtype(rec["emb_dtype"]).newbyteorder("<")
        out["text_emb"] = np.frombuffer(rec["text_emb"], dtype).reshape(rec["text_len"], emb_dim).astype(np.float32)
    return out


def read_manifest(path: str | Path) -> dict:
    """The manifest of shard directory `path`; FileNotFoundError with the fix when it is missing."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        hint = (
            "preparation has not finished there: rerun the same scripts/prepare_data.py command to resume"
            if any(Path(path).glob("shard-*"))
            else "prepare one with scripts/prepare_data.py (see docs/data.md)"
        )
        raise FileNotFoundError(f"no {MANIFEST} in shard directory {str(path)!r}: {hint}")
    manifest = json.loads(file.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{file} is not a {FORMAT} v{VERSION} manifest")
    return manifest


class ShardSource:
    """Random access over a prepared shard directory: `src[i]` -> dict(image uint8 [H, W, 3], caption str,
    key str, bucket int, and text_emb f32 [text_len, D] when the shards carry embeddings).

    Attributes: `num_samples`, `resolution`, `buckets` (tuple of (H, W); empty without buckets), `encoder`
    (manifest dict or None), `emb_dim`, `max_len` (text tokens per caption, 0 without an encoder).
    """

    def __init__(self, path: str | Path):
        import grain

        self.path = Path(path)
        self.manifest = m = read_manifest(self.path)
        files = [str(self.path / s["file"]) for s in m["shards"] if s["count"] > 0]
        if not files:
            raise ValueError(f"shard directory {str(self.path)!r} holds no records (all inputs were skipped?)")
        self._source = grain.sources.ArrayRecordDataSource(files)
        self.num_samples = len(self._source)
        if self.num_samples != m["count"]:
            raise ValueError(f"{self.path}: manifest says {m['count']} records, the shards hold {self.num_samples}")
        self.resolution = int(m["resolution"])
        self.buckets = tuple(tuple(int(v) for v in b) for b in m["buckets"])
        self.encoder = m["encoder"]
        self.emb_dim = int(self.encoder["dim"]) if self.encoder else 0
        self.max_len = int(self.encoder["max_len"]) if self.encoder else 0

    def __len__(self) -> int:
        return self.num_samples

    def _raw(self, index: int) -> bytes:
        i = int(index)
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {i} out of range [0, {self.num_samples})")
        return self._source[i]

    def __getitem__(self, index: int) -> dict[str, Any]:
        return decode_record(self._raw(index), self.emb_dim)

    def caption(self, index: int) -> str:
        """The caption of record `index` (the image is not decoded)."""
        return decode_record(self._raw(index), self.emb_dim, with_image=False)["caption"]

    def image_shape(self, bucket: int) -> tuple[int, int]:
        """(H, W) of the images of `bucket` (-1: the square resolution)."""
        return self.buckets[bucket] if bucket >= 0 else (self.resolution, self.resolution)

    def bucket_members(self) -> list[np.ndarray]:
        """Global record indices of each bucket, int64 arrays in record order (one entry per bucket)."""
        members: list[list[np.ndarray]] = [[] for _ in self.buckets]
        start = 0
        for shard in self.manifest["shards"]:
            for b, n in enumerate(shard["bucket_counts"]):
                members[b].append(np.arange(start, start + n, dtype=np.int64))
                start += n
        return [np.concatenate(m) if m else np.zeros((0,), np.int64) for m in members]
