"""The command line of scripts/prepare_data.py: image-caption data (a folder, WebDataset tars, or the synthetic
shapes) into ArrayRecord shards, with a frozen text encoder's embeddings."""

from __future__ import annotations

import argparse
from pathlib import Path

from reve_jax import cli
from reve_jax.data import buckets, prepare


def main(argv: list[str] | None = None, doc: str = __doc__) -> dict:
    """scripts/prepare_data.py: parses argv, prepares the shards, prints the summary and returns the manifest."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    folder = sub.add_parser("folder", help="images with <name>.txt captions or a captions.jsonl")
    folder.add_argument("src", help="image folder (searched recursively)")
    wds = sub.add_parser("webdataset", help="WebDataset tar shards (<key>.jpg + <key>.txt or .json)")
    wds.add_argument("tars", nargs="+", help="tar files, one output shard each")
    syn = sub.add_parser("synthetic", help="the procedural captioned shapes (reve_jax.data.synthetic)")
    syn.add_argument("--num", type=int, required=True, help="samples 0..num-1")
    syn.add_argument("--image-size", type=int, default=32)
    syn.add_argument("--max-objects", type=int, default=3)
    syn.add_argument("--seed", type=int, default=0, help="the synthetic content seed (data.seed)")
    for p in (folder, wds, syn):
        p.add_argument("--out", required=True, help="output shard directory")
        p.add_argument("--shard-size", type=int, default=1000, help="images per shard (folder, synthetic)")
        p.add_argument("--image-format", choices=("raw", "png", "jpeg"), default="raw")
        p.add_argument("--jpeg-quality", type=int, default=95)
        p.add_argument("--encoder", choices=("none", "minilm", "t5", "t5gemma", "qwen"), default="none")
        p.add_argument("--encoder-path", default=None, help="local weights directory (default for minilm: packaged)")
        p.add_argument("--max-len", type=int, default=64, help="text tokens per caption, padding at the end")
        p.add_argument("--emb-dtype", choices=("float32", "float16"), default="float32")
        p.add_argument("--encode-batch", type=int, default=32, help="captions per encoder call")
        p.add_argument("--workers", type=int, default=None, help="decode processes (default: all cores; 0: none)")
        p.add_argument("--overwrite", action="store_true", help="start over instead of resuming")
        p.add_argument("--no-progress", action="store_true")
        p.add_argument("--dry-run", action="store_true", help="check the options and the inputs, then exit")
    for p in (folder, wds):
        p.add_argument("--resolution", type=int, required=True, help="square side, or the bucket token budget")
        p.add_argument("--min-side", type=int, default=0, help="skip smaller images (default: resolution/2)")
        p.add_argument("--buckets", action="store_true", help="aspect-ratio buckets instead of center crops")
        p.add_argument("--patch", type=int, default=16, help="model patch size (sets the bucket token budget)")
        p.add_argument("--bucket-multiple", type=int, default=None, help="bucket sides multiple of (default: patch)")
        p.add_argument("--aspect-ratios", default=",".join(buckets.DEFAULT_RATIOS), help="W:H list for buckets")
    args = parser.parse_args(argv)
    inputs = [args.src] if args.kind == "folder" else getattr(args, "tars", [])
    if args.dry_run:  # checked before the sources open them (a folder source lists its images)
        missing = [p for p in [*inputs, args.encoder_path] if p and not Path(p).exists()]
        if missing:
            raise SystemExit(f"error: input not found: {', '.join(missing)}")

    if args.kind == "synthetic":
        source = prepare.SyntheticSource(args.num, args.image_size, args.max_objects, args.seed, args.shard_size)
        spec = prepare.ImageSpec(args.image_size, image_format=args.image_format, jpeg_quality=args.jpeg_quality)
    else:
        if args.kind == "folder":
            source = prepare.FolderSource(args.src, args.shard_size)
        else:
            source = prepare.WebDatasetSource(args.tars)
        bucket_list = (
            buckets.make_buckets(args.resolution, args.patch, args.aspect_ratios.split(","), args.bucket_multiple)
            if args.buckets
            else ()
        )
        spec = prepare.ImageSpec(
            args.resolution, bucket_list, args.image_format, args.jpeg_quality, min_side=args.min_side
        )
    if args.dry_run:
        size = f"{spec.resolution} px" + (f" in {len(spec.buckets)} aspect buckets" if spec.buckets else "")
        cli.dry_run_exit(
            f"would prepare {' '.join([args.kind, *inputs])} into {args.out} ({source.num_units()} shards) at {size}, "
            f"{args.image_format} images, encoder {args.encoder}"
        )
    encoder = None
    if args.encoder != "none":
        from reve_jax.text_encoders import load_encoder

        encoder = load_encoder(args.encoder, args.encoder_path, args.max_len, args.encode_batch)
    manifest = prepare.prepare(
        source,
        args.out,
        spec,
        encoder=encoder,
        emb_dtype=args.emb_dtype,
        encode_batch=args.encode_batch,
        workers=args.workers,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    print(prepare.summary_text(manifest))
    return manifest
