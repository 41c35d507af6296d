"""Converts official PyTorch checkpoints of the perceptual networks into the `.npz` files the trainer loads.

    # LPIPS: torchvision's VGG16 (IMAGENET1K_V1) state dict + the heads shipped in the lpips package
    python scripts/convert_weights.py lpips --vgg vgg16-397923af.pth --out weights/lpips_vgg.npz \
        [--lin .../lpips/weights/v0.1/vgg.pth]

    # DINOv2: a torch-hub checkpoint, a .safetensors file, or a transformers save_pretrained directory
    python scripts/convert_weights.py dinov2 --src dinov2_vitb14_reg4_pretrain.pth \
        --out weights/dinov2_b14_reg.npz

Without --lin, the heads come from the installed lpips package (`pip install --no-deps lpips`). Nothing is
downloaded: see docs/perceptual.md for where the official files come from.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from reve_jax import cli
from reve_jax.perceptual.weights import convert_dinov2, convert_lpips, shipped_lpips_heads


def main(argv: list[str] | None = None) -> Path:
    """Parses argv, converts, prints and returns the output path."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    lp = sub.add_parser("lpips", help="torchvision VGG16 state dict + lpips linear heads")
    lp.add_argument("--vgg", required=True, help="torchvision vgg16 state dict (features.N.weight/bias)")
    lp.add_argument("--lin", default=None, help="lpips heads file (default: the installed lpips package's)")
    lp.add_argument("--out", required=True)
    dn = sub.add_parser("dinov2", help="DINOv2 backbone, torch-hub or transformers layout")
    dn.add_argument("--src", required=True, help=".pth (hub), .safetensors, or a save_pretrained directory")
    dn.add_argument("--out", required=True)
    dn.add_argument("--num-heads", type=int, default=None, help="default: config.json, else width // 64")
    for p in (lp, dn):
        p.add_argument("--dry-run", action="store_true", help="check the inputs exist, then exit")
    args = parser.parse_args(argv)
    if args.dry_run:
        try:
            inputs = [args.vgg, args.lin or shipped_lpips_heads()] if args.kind == "lpips" else [args.src]
        except FileNotFoundError as e:  # lpips is not installed
            raise SystemExit(f"error: {e}") from None
        missing = [str(p) for p in inputs if not Path(p).exists()]
        if missing:
            raise SystemExit(f"error: input not found: {', '.join(missing)}")
        cli.dry_run_exit(f"would convert {args.kind} from {' + '.join(map(str, inputs))} into {args.out}")
    if args.kind == "lpips":
        out = convert_lpips(args.vgg, args.lin, args.out)
    else:
        out = convert_dinov2(args.src, args.out, num_heads=args.num_heads)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
