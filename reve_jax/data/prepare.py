"""Preparing image-caption data into the ArrayRecord shards the training pipeline reads (format: shards.py).

Sources: a folder of images with a caption each (`<name>.txt` beside `<name>.jpg`, or a `captions.jsonl` of
{"file": relative path, "caption": text} lines), WebDataset tar shards (`<key>.jpg` + `<key>.txt` or
`<key>.json` with a "caption"), or the synthetic shapes dataset (so it can train on real frozen embeddings).

How a run goes. The inputs are listed in a fixed order and cut into units (a folder: `shard_size` images; a
WebDataset: one tar), one output shard per unit. A process pool decodes, crops and resizes every image (or
fits it to its aspect bucket); the main process runs the frozen text encoder on each shard's captions in
fixed-size batches and writes the shard to a temporary name, then its sidecar JSON, then renames the shard:
the rename is the commit. A rerun of the same command skips committed shards and redoes the rest, so an
interrupted run resumes without redoing work and ends with the same bytes as an uninterrupted one. Bad input
(unreadable or truncated image, missing caption, image smaller than `min_side`) is skipped and listed in the
manifest's `skipped`, never fatal.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import io
import json
import multiprocessing
import os
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from reve_jax.data import buckets as bucketing
from reve_jax.data import shards

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
CAPTIONS_JSONL = "captions.jsonl"
PLAN = "plan.json"


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """How images are stored.

    resolution: side of the square output (and the token budget of the buckets).
    buckets: (H, W) aspect buckets (see buckets.make_buckets); empty = center-crop to a square.
    image_format: raw | png | jpeg (see shards.py); jpeg_quality applies to jpeg.
    min_side: images whose shorter side is below this are skipped; 0 = resolution // 2.
    """

    resolution: int
    buckets: tuple[tuple[int, int], ...] = ()
    image_format: str = "raw"
    jpeg_quality: int = 95
    min_side: int = 0

    def __post_init__(self):
        if self.resolution < 1:
            raise ValueError(f"resolution={self.resolution} must be >= 1")
        if self.image_format not in shards.IMAGE_FORMATS:
            raise ValueError(f"image_format={self.image_format!r}; expected one of {shards.IMAGE_FORMATS}")

    @property
    def smallest_side(self) -> int:
        return self.min_side if self.min_side > 0 else max(1, self.resolution // 2)


@dataclasses.dataclass(frozen=True)
class Item:
    """One input sample. `source` names it in the summary; the image comes from `path`, `data` (bytes) or
    synthetic sample `index`; the caption from `caption` or the text file `caption_path` (None: missing).
    `error` marks input that could not even be listed (it is skipped with that reason)."""

    source: str
    path: str | None = None
    data: bytes | None = None
    index: int = -1
    caption: str | None = None
    caption_path: str | None = None
    error: str | None = None


# ------------------------------------------------------------------------------------------------ sources


class FolderSource:
    """Images under `root` (recursively, sorted by relative path), `shard_size` images per output shard."""

    kind = "folder"

    def __init__(self, root: str | Path, shard_size: int = 1000):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"image folder {str(self.root)!r} does not exist")
        self.shard_size = int(shard_size)
        files = sorted(
            p.relative_to(self.root).as_posix()
            for p in self.root.rglob("*")
            if p.suffix.lower() in IMAGE_EXTS and p.is_file()
        )
        self.files = files
        self.num_items: int | None = len(files)
        self._jsonl = self._read_jsonl()

    def _read_jsonl(self) -> dict[str, str]:
        file = self.root / CAPTIONS_JSONL
        if not file.is_file():
            return {}
        captions = {}
        for line in file.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                name = row.get("file") or row.get("image") or row.get("path")
                text = row.get("caption", row.get("text"))
            except (json.JSONDecodeError, AttributeError):
                continue  # a broken line loses only its own caption (that image is then skipped)
            if isinstance(name, str) and isinstance(text, str):
                captions[Path(name).as_posix()] = text
        return captions

    def describe(self) -> dict:
        digest = hashlib.sha256("\n".join(self.files).encode()).hexdigest()
        return {"kind": self.kind, "path": str(self.root.resolve()), "files": len(self.files), "sha256": digest}

    def num_units(self) -> int:
        return -(-len(self.files) // self.shard_size)

    def unit_items(self, unit: int) -> Iterator[Item]:
        for rel in self.files[unit * self.shard_size : (unit + 1) * self.shard_size]:
            txt = (self.root / rel).with_suffix(".txt")
            yield Item(
                source=rel,
                path=str(self.root / rel),
                caption=self._jsonl.get(rel),
                caption_path=str(txt) if rel not in self._jsonl and txt.is_file() else None,
            )


class WebDatasetSource:
    """WebDataset tar files (in the order given), one output shard per tar. A sample is the run of members
    sharing a key (the member path up to the first dot of its file name)."""

    kind = "webdataset"

    def __init__(self, tars: Sequence[str | Path]):
        self.tars = [Path(t) for t in tars]
        if not self.tars:
            raise ValueError("no WebDataset tar files given")
        missing = [str(t) for t in self.tars if not t.is_file()]
        if missing:
            raise FileNotFoundError(f"WebDataset tar files not found: {missing}")
        self.num_items = None

    def describe(self) -> dict:
        sizes = [[str(t.resolve()), t.stat().st_size] for t in self.tars]
        return {"kind": self.kind, "tars": sizes}

    def num_units(self) -> int:
        return len(self.tars)

    def unit_items(self, unit: int) -> Iterator[Item]:
        tar_path = self.tars[unit]
        key, files = None, {}
        try:
            with tarfile.open(tar_path, "r:*") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    folder, _, base = member.name.rpartition("/")
                    stem, dot, ext = base.partition(".")
                    if not dot:
                        continue
                    k = f"{folder}/{stem}" if folder else stem
                    if k != key and key is not None:
                        yield self._item(tar_path, key, files)
                        files = {}
                    key = k
                    files[ext.lower()] = tar.extractfile(member).read()
        except (tarfile.TarError, OSError, EOFError) as e:
            # A damaged tar loses only what follows the damage; what was read is kept.
            if key is not None:
                yield self._item(tar_path, key, files)
                key = None
            yield Item(source=f"{tar_path.name}:<rest>", error=f"unreadable tar ({type(e).__name__}: {e})")
            return
        if key is not None:
            yield self._item(tar_path, key, files)

    @staticmethod
    def _item(tar_path: Path, key: str, files: dict[str, bytes]) -> Item:
        image = next((files[e] for e in ("jpg", "jpeg", "png", "webp", "bmp") if e in files), None)
        caption = None
        if "txt" in files:
            caption = files["txt"].decode("utf-8", errors="replace")
        elif "json" in files:
            try:
                meta = json.loads(files["json"])
                caption = meta.get("caption", meta.get("text")) if isinstance(meta, dict) else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                caption = None
        # An empty bytes object marks "no image in this sample" (a data-less Item reads as a tar error).
        return Item(source=f"{tar_path.name}:{key}", data=image if image is not None else b"", caption=caption)


class SyntheticSource:
    """The synthetic shapes dataset, samples [0, num), `shard_size` per output shard."""

    kind = "synthetic"

    def __init__(self, num: int, image_size: int, max_objects: int = 3, seed: int = 0, shard_size: int = 1000):
        from reve_jax.data import synthetic

        self.dataset = synthetic.SyntheticShapes(image_size, num, seed, max_objects)
        self.shard_size = int(shard_size)
        self.num_items = int(num)

    def describe(self) -> dict:
        d = self.dataset
        return {"kind": self.kind, "num": d.num_samples, "image_size": d.image_size, "seed": d.seed,
                "max_objects": d.max_objects}  # fmt: skip

    def num_units(self) -> int:
        return -(-self.num_items // self.shard_size)

    def unit_items(self, unit: int) -> Iterator[Item]:
        for i in range(unit * self.shard_size, min(self.num_items, (unit + 1) * self.shard_size)):
            yield Item(source=f"synthetic/{i}", index=i)


# ------------------------------------------------------------------------------------------------ images


def fit_image(image, height: int, width: int) -> np.ndarray:
    """Center-crops a PIL image to the aspect of height x width and resizes it there (bicubic, antialiased
    when shrinking); returns uint8 [height, width, 3]. An image already at that size comes back unchanged."""
    from PIL import Image

    w0, h0 = image.size
    scale = max(width / w0, height / h0)
    crop_w, crop_h = width / scale, height / scale
    left, top = (w0 - crop_w) / 2, (h0 - crop_h) / 2
    box = (left, top, left + crop_w, top + crop_h)
    out = image.resize((width, height), Image.Resampling.BICUBIC, box=box)
    return np.asarray(out, np.uint8)


def _to_rgb(image):
    """Any PIL mode -> RGB; transparent pixels are composited on white (black would invent dark shapes)."""
    from PIL import Image

    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return image.convert("RGB")


class _Skip(Exception):
    """An input that is fine to read but not fit to keep (the message is the reason)."""


@dataclasses.dataclass(frozen=True)
class _Worker:
    """Pool task: Item -> ("ok", source, fields) or ("skip", source, reason). Never raises on bad input."""

    spec: ImageSpec
    synthetic: Any = None  # SyntheticShapes for a synthetic source

    def __call__(self, item: Item) -> tuple[str, str, Any]:
        try:
            return self._process(item)
        except Exception as e:  # bad input of any kind is skipped, never fatal
            return "skip", item.source, f"error ({type(e).__name__}: {e})"

    def _process(self, item: Item) -> tuple[str, str, Any]:
        spec = self.spec
        if item.index >= 0:
            sample = self.synthetic[item.index]
            image, caption = sample["image"], sample["caption"]
            h0, w0 = image.shape[:2]
            bucket = -1
            if (h0, w0) != (spec.resolution, spec.resolution):
                raise ValueError(f"synthetic image is {h0}x{w0}, expected {spec.resolution}")
        else:
            if item.error is not None:
                return "skip", item.source, item.error
            caption = item.caption
            if caption is None and item.caption_path is not None:
                caption = Path(item.caption_path).read_text(encoding="utf-8", errors="replace")
            caption = caption.strip() if caption else ""
            if not caption:
                return "skip", item.source, "missing caption"
            if item.data is not None and not item.data:
                return "skip", item.source, "no image file in sample"
            try:
                image, (h0, w0), bucket = self._load(item)
            except _Skip as e:
                return "skip", item.source, str(e)
            except Exception as e:  # corrupt, truncated or not an image at all
                return "skip", item.source, f"unreadable image ({type(e).__name__}: {e})"
        h, w = image.shape[:2]
        fields = {
            "caption": caption,
            "image": shards.encode_image(image, spec.image_format, spec.jpeg_quality),
            "height": h,
            "width": w,
            "bucket": bucket,
            "orig_size": (h0, w0),
        }
        return "ok", item.source, fields

    def _load(self, item: Item) -> tuple[np.ndarray, tuple[int, int], int]:
        """Decodes and fits one image: (uint8 [H, W, 3], original (h, w), bucket or -1); _Skip if too small."""
        from PIL import Image, ImageOps

        spec = self.spec
        src = item.path if item.path is not None else io.BytesIO(item.data)
        with Image.open(src) as im:
            im.load()  # decode now: a truncated file fails here rather than later
            im = ImageOps.exif_transpose(im)
            w0, h0 = im.size
            if min(h0, w0) < spec.smallest_side:
                raise _Skip(f"too small ({w0}x{h0} < {spec.smallest_side} px)")
            if spec.buckets:
                bucket = bucketing.nearest_bucket(h0, w0, spec.buckets)
                h, w = spec.buckets[bucket]
            else:
                bucket, h, w = -1, spec.resolution, spec.resolution
            return fit_image(_to_rgb(im), h, w), (h0, w0), bucket


# ------------------------------------------------------------------------------------------------ running


def _ordered_results(fn: Callable[[Any], Any], tasks: Iterable[Any], workers: int, window: int = 256) -> Iterator[Any]:
    """fn over tasks, results in task order: in a pool of `workers` processes, or inline when 0.

    At most `window` tasks are in flight, so a large WebDataset is never read into memory ahead of the pool.
    A worker that dies (e.g. killed for memory) raises BrokenProcessPool here instead of hanging; committed
    shards are kept and a rerun resumes.
    """
    if workers <= 0:
        yield from map(fn, tasks)
        return
    # spawn, not fork: the parent has JAX's threads running, and forking those is unsafe.
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        pending: collections.deque = collections.deque()
        try:
            for task in tasks:
                pending.append(pool.submit(fn, task))
                if len(pending) >= window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def _sidecar_path(out: Path, unit: int) -> Path:
    return (out / shards.shard_name(unit)).with_suffix(".json")


def _is_complete(out: Path, unit: int) -> bool:
    side = _sidecar_path(out, unit)
    if not (out / shards.shard_name(unit)).is_file() or not side.is_file():
        return False
    try:
        json.loads(side.read_text())
    except json.JSONDecodeError:
        return False
    return True


def _write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write: a temp file, fsync, rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _commit_shard(out: Path, unit: int, records: list[bytes], info: dict) -> None:
    """Writes shard `unit`: records to a temp file, then the sidecar, then the rename that commits it."""
    from array_record.python.array_record_module import ArrayRecordWriter

    final = out / shards.shard_name(unit)
    tmp = final.with_name(final.name + ".tmp")
    writer = ArrayRecordWriter(str(tmp), "group_size:1")
    for rec in records:
        writer.write(rec)
    writer.close()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    _write_json(_sidecar_path(out, unit), info)
    os.replace(tmp, final)


def _check_plan(out: Path, plan: dict, overwrite: bool) -> None:
    """Records the run's settings on the first run; a rerun must use the same ones (or --overwrite)."""
    file = out / PLAN
    if file.is_file() and not overwrite:
        old = json.loads(file.read_text())
        if old != plan:
            changed = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
            raise ValueError(
                f"{out} was prepared with different settings ({', '.join(changed)} differ) or the input changed. "
                "Rerun with the original settings to resume, pick a new output directory, or pass --overwrite "
                "to start over."
            )
        return
    if overwrite:
        for f in out.glob("shard-*"):
            f.unlink()
        (out / shards.MANIFEST).unlink(missing_ok=True)
    _write_json(file, plan)


def _encode_shard(encoder, captions: list[str], batch: int):
    """Encodes captions in fixed batches of `batch` (the last one padded) so the compiled shape never changes
    and a resumed shard gets bit-identical embeddings."""
    embs, lens, cut = [], [], 0
    for i in range(0, len(captions), batch):
        chunk = captions[i : i + batch]
        enc = encoder.encode(chunk + [""] * (batch - len(chunk)))
        embs += list(enc.emb[: len(chunk)])
        lens += [int(n) for n in enc.mask[: len(chunk)].sum(1)]
        cut += int(enc.truncated[: len(chunk)].sum())
    return embs, lens, cut


def prepare(
    source,
    out_dir: str | Path,
    spec: ImageSpec,
    *,
    encoder=None,
    emb_dtype: str = "float32",
    encode_batch: int = 32,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Writes `source` (FolderSource, WebDatasetSource or SyntheticSource) as shards into `out_dir`.

    Args:
      spec: output image size, buckets and format.
      encoder: a frozen text encoder (reve_jax.text_encoders.load_encoder) or None for captions only.
      emb_dtype: storage dtype of the embeddings (float32 or float16).
      encode_batch: captions per encoder call.
      workers: decode/resize processes; None = every core, 0 = in this process.
      overwrite: discard earlier shards in out_dir instead of resuming.
      progress: show a tqdm progress bar.
    Returns the manifest (also written to out_dir/manifest.json): count, shards, resolution, buckets, encoder,
    skipped (list of {"source", "reason"}), truncated_captions, and the run's settings.
    """
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    enc_info = (
        {"name": encoder.name, "dim": int(encoder.dim), "max_len": int(encoder.max_len), "dtype": emb_dtype}
        if encoder is not None
        else None
    )
    plan = {"source": source.describe(), "spec": dataclasses.asdict(spec), "encoder": enc_info}
    plan = json.loads(json.dumps(plan))  # tuples -> lists, as read back from disk
    _check_plan(out, plan, overwrite)
    for stale in out.glob("*.tmp"):
        stale.unlink()  # half-written files of an interrupted run
    units = range(source.num_units())
    pending = [u for u in units if not _is_complete(out, u)]
    done_items = sum(_sidecar(out, u)["items"] for u in units if u not in pending)
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    synthetic = getattr(source, "dataset", None)

    def tasks():
        for u in pending:
            for item in source.unit_items(u):
                yield u, item
            yield u, None  # end of unit

    worker = _Worker(spec, synthetic)
    bar = tqdm(total=source.num_items, initial=done_items, unit="img", disable=not progress, desc="prepare")
    stream = _ordered_results(_UnitTask(worker), tasks(), workers)
    # closing(): an interruption shuts the pool down at once, not when the traceback is collected.
    with contextlib.closing(stream), bar:
        results: list[tuple[str, str, Any]] = []
        for unit, result in stream:
            if result is not None:
                results.append(result)
                bar.update(1)
                continue
            _finish_unit(out, unit, results, spec, encoder, emb_dtype, encode_batch)
            results = []
    manifest = _manifest(out, source, spec, enc_info, len(units))
    _write_json(out / shards.MANIFEST, manifest)
    return manifest


@dataclasses.dataclass(frozen=True)
class _UnitTask:
    """(unit, Item or None) -> (unit, worker result or None): keeps the unit tag through the pool."""

    worker: _Worker

    def __call__(self, task):
        unit, item = task
        return unit, None if item is None else self.worker(item)


def _finish_unit(out, unit, results, spec, encoder, emb_dtype, encode_batch) -> None:
    ok = [(src, f) for kind, src, f in results if kind == "ok"]
    skipped = [{"source": src, "reason": reason} for kind, src, reason in results if kind == "skip"]
    # Records sorted by bucket (stable): each bucket is then a contiguous range of every shard.
    ok.sort(key=lambda r: r[1]["bucket"])
    embs, lens, cut = (None, None, 0)
    if encoder is not None and ok:
        embs, lens, cut = _encode_shard(encoder, [f["caption"] for _, f in ok], encode_batch)
    records = []
    for i, (src, f) in enumerate(ok):
        emb = embs[i][: lens[i]] if embs is not None else None
        records.append(
            shards.encode_record(
                src,
                f["caption"],
                f["image"],
                spec.image_format,
                f["height"],
                f["width"],
                bucket=f["bucket"],
                orig_size=f["orig_size"],
                text_emb=emb,
                emb_dtype=emb_dtype,
            )  # fmt: skip
        )
    counts = collections.Counter(f["bucket"] for _, f in ok)
    info = {
        "file": shards.shard_name(unit),
        "count": len(records),
        "items": len(results),
        "bucket_counts": [counts.get(b, 0) for b in range(len(spec.buckets))],
        "skipped": skipped,
        "truncated_captions": cut,
    }
    _commit_shard(out, unit, records, info)


def _sidecar(out: Path, unit: int) -> dict:
    return json.loads(_sidecar_path(out, unit).read_text())


def _manifest(out: Path, source, spec: ImageSpec, enc_info: dict | None, num_units: int) -> dict:
    infos = [_sidecar(out, u) for u in range(num_units)]
    skipped = [s for info in infos for s in info["skipped"]]
    bucket_counts = [sum(info["bucket_counts"][b] for info in infos) for b in range(len(spec.buckets))]
    return {
        "format": shards.FORMAT,
        "version": shards.VERSION,
        "count": sum(info["count"] for info in infos),
        "resolution": spec.resolution,
        "buckets": [list(b) for b in spec.buckets],
        "bucket_counts": bucket_counts,
        "image_format": spec.image_format,
        "encoder": enc_info,
        "num_inputs": sum(info["items"] for info in infos),
        "num_skipped": len(skipped),
        "skip_reasons": dict(collections.Counter(_reason_kind(s["reason"]) for s in skipped)),
        "skipped": skipped,
        "truncated_captions": sum(info["truncated_captions"] for info in infos),
        "source": source.describe(),
        "shards": [{k: info[k] for k in ("file", "count", "bucket_counts")} for info in infos],
    }


def _reason_kind(reason: str) -> str:
    """The reason's kind for the summary counts: the text before the first ':' or '('."""
    return reason.split(":")[0].split("(")[0].strip()


def summary_text(manifest: dict, max_names: int = 20) -> str:
    """A human summary of a manifest: counts, skip reasons, and the first `max_names` skipped inputs."""
    lines = [
        f"{manifest['count']} records in {len(manifest['shards'])} shards from {manifest['num_inputs']} inputs "
        f"at {manifest['resolution']} px"
        + (f" in {len(manifest['buckets'])} aspect buckets" if manifest["buckets"] else ""),
    ]
    if manifest["encoder"]:
        e = manifest["encoder"]
        lines.append(
            f"text embeddings: {e['name']} dim {e['dim']}, max_len {e['max_len']} "
            f"({manifest['truncated_captions']} captions truncated)"
        )
    lines.append(f"skipped {manifest['num_skipped']}: {manifest['skip_reasons'] or 'none'}")
    for s in manifest["skipped"][:max_names]:
        lines.append(f"  {s['source']}: {s['reason']}")
    if manifest["num_skipped"] > max_names:
        lines.append(f"  ... and {manifest['num_skipped'] - max_names} more (see manifest.json)")
    return "\n".join(lines)
