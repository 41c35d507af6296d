"""Run a documented command only as far as its arguments: `python tests/parse_only.py scripts/x.py ARGS...` or
`python tests/parse_only.py -m package.module ARGS...` (tests/test_docs_commands.py, for the commands whose work
needs hosts, a cluster or minutes).

The script runs as `__main__` until its arguments are parsed, then prints `arguments parsed: ...` and exits 0
before any work. After `ArgumentParser.parse_args` argparse has rejected any unknown option. A script that takes
config overrides (`parse_known_args`, the scripts' one vocabulary: `--config FILE` and `--config.a.b=v`) has its
other arguments checked to be overrides and its config loaded with them here, which rejects an unknown key or a
bad value. An error exits as the script's would: status 2 and one line.
"""

import argparse
import os
import runpy
import sys

_parse_args = argparse.ArgumentParser.parse_args
_parse_known_args = argparse.ArgumentParser.parse_known_args
_inside_parse_args = [0]


def _done(what: str):
    print(f"arguments parsed: {what}", flush=True)
    sys.stderr.flush()
    os._exit(0)  # no atexit work, no threads joined: nothing of the command runs


def parse_args(self, args=None, namespace=None):
    _inside_parse_args[0] += 1  # argparse's parse_args calls parse_known_args
    try:
        namespace = _parse_args(self, args, namespace)
    finally:
        _inside_parse_args[0] -= 1
    _done(repr(namespace))


def parse_known_args(self, args=None, namespace=None):
    namespace, rest = _parse_known_args(self, args, namespace)
    if _inside_parse_args[0]:
        return namespace, rest
    unknown = [a for a in rest if not a.startswith("--config.")]
    if unknown:
        self.error(f"unrecognised arguments: {' '.join(unknown)}")
    if getattr(namespace, "config", None):
        from reve_jax import config

        try:
            config.load_config(namespace.config, rest)
        except config.ConfigError as e:
            print(f"config error: {e}", file=sys.stderr, flush=True)
            os._exit(2)
    _done(f"{namespace!r} {rest}")


def main():
    argv = sys.argv[1:]
    # sys.path[0] as `python -m` (the working directory) or `python script.py` (the script's folder) sets it.
    sys.path[0] = os.getcwd() if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))
    argparse.ArgumentParser.parse_args = parse_args
    argparse.ArgumentParser.parse_known_args = parse_known_args
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit("the command ended without parsing its arguments: give it a quick form in tests/test_docs_commands.py")


if __name__ == "__main__":
    main()
