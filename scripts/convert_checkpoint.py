"""Convert a run's newest checkpoint to another parameter layout, into a new workdir, and resume there.

    python scripts/convert_checkpoint.py --workdir runs/a --out runs/a_scan --config.model.scan_layers=True
    python scripts/train.py --config configs/base.py --workdir runs/a_scan --config.model.scan_layers=True

May change `model.scan_layers` (per-block <-> stacked blocks) and `optim.muon_patterns` (a pattern that selects
the same weights). The source is only read; the destination must hold no checkpoint. See reve_jax/convert.py.
"""

import argparse
import sys

from reve_jax import checkpoint, cli, config, convert


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="the run to convert (only read)")
    parser.add_argument("--out", required=True, help="new workdir that receives the converted checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="check the conversion is allowed, write nothing")
    args, overrides = cli.parse_args(parser, argv)
    cli.setup_logging()
    try:
        summary = convert.convert_workdir(args.workdir, args.out, overrides, dry_run=args.dry_run)
    except (convert.ConversionError, checkpoint.CheckpointError, config.ConfigError) as e:
        sys.exit(f"conversion error: {e}")
    if args.dry_run:
        cli.dry_run_exit(f"would write step {summary['step']} to {args.out}; changed: {summary['changed']}")
    print(f"wrote step {summary['step']} ({summary['leaves']} arrays) to {args.out}; changed: {summary['changed']}")
    return summary


if __name__ == "__main__":
    main()
