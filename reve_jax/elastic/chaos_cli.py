"""The main of scripts/chaos.py: the chaos soak of the elastic launcher on the namespace bed."""

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str], doc: str = __doc__) -> int:
    if "--worker" in argv:
        from reve_jax.elastic.soakcheck import worker_main

        return worker_main([a for a in argv if a != "--worker"])
    from reve_jax.elastic import chaos

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = chaos.Settings()
    p.add_argument("--hosts", type=int, default=d.hosts)
    p.add_argument("--steps", type=int, default=d.steps, help="at least this many (more if the faults need them)")
    p.add_argument("--faults-per-kind", type=int, default=d.faults_per_kind)
    p.add_argument("--kinds", default=",".join(d.kinds), help=f"comma list of {', '.join(chaos.KINDS)}")
    p.add_argument("--seed", type=int, default=d.seed, help="the order of the faults and their hosts")
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    p.add_argument("--snapshot-every", type=int, default=d.snapshot_every)
    p.add_argument("--rtol", type=float, default=d.rtol, help="largest relative loss difference allowed per step")
    p.add_argument("--timeout", type=float, default=d.timeout, help="s for any one wait")
    p.add_argument(
        "--no-settle",
        action="store_true",
        help="a fault as soon as the group trains on 2 hosts or more, without waiting for the failed host to come "
        "back, for standbys or for the compile-ahead (the short form in the tests)",
    )
    p.add_argument("--dir", default="", help="where the run goes (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the run directory (removed when every check passed)")
    p.add_argument("--report", default="", help="write the rows, the checks and the table here (JSON)")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = sorted(set(kinds) - set(chaos.KINDS))
    if unknown or not kinds:
        p.error(f"--kinds {args.kinds!r}: {unknown or 'none'} not among {', '.join(chaos.KINDS)}")
    if args.hosts < 2:
        p.error("--hosts: at least 2 (a fault takes one out)")
    from reve_jax.elastic.testbed import NetnsBed

    why = NetnsBed.unavailable()
    if why:
        print(f"chaos: no namespace bed here: {why}", file=sys.stderr)
        return 2
    s = chaos.Settings(
        hosts=args.hosts, steps=args.steps, faults_per_kind=args.faults_per_kind, kinds=kinds, seed=args.seed,
        ckpt_every=args.ckpt_every, snapshot_every=args.snapshot_every, rtol=args.rtol, timeout=args.timeout,
        settle=not args.no_settle,
    )  # fmt: skip
    root = Path(args.dir or tempfile.mkdtemp(prefix="chaos_")).absolute()
    root.mkdir(parents=True, exist_ok=True)
    print(f"chaos: {args.hosts} hosts, {len(kinds) * args.faults_per_kind} faults ({', '.join(kinds)}), "
          f"{s.steps_needed()} steps, seed {args.seed}, in {root}; {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    # SIGTERM ends the soak like Ctrl-C: the bed, the launcher and the mounts are cleaned up on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.time()
    report = chaos.soak(s, root, say=lambda line: print(line, flush=True))
    report["seconds"] = round(time.time() - t0, 1)
    print("\n" + chaos.table(report["rows"]))
    for problem in report["problems"]:
        print(f"FAILED: {problem}")
    verdict = f"{len(report['problems'])} problems" if report["problems"] else "every check passed"
    print(f"{len(report['rows'])} faults in {report['seconds']:.0f} s; loss against the uninterrupted run "
          f"{report['loss']}; {verdict}")  # fmt: skip
    if args.report:
        chaos.write_report(Path(args.report), report)
    if not report["problems"] and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if not report["problems"] else 1
