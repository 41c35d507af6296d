"""A process that has imported the heavy libraries once and forks a child for each documented command
(tests/test_docs_commands.py): the command then starts in a fraction of a second instead of the ~2 s of importing
JAX, Flax, Optax, Orbax and Grain, which was most of each quick form's time.

Protocol, one JSON object per line: a request {"argv": [...], "env": {...}, "cwd": "...", "out": "...", "err":
"...", "timeout": s} on stdin, where argv is what follows `python` (`script.py ...` or `-m module ...`); the reply
{"code": exit status} on stdout once the child has ended (-9: killed at its timeout). One request at a time.

The child is the command as `python argv...` would run it: the request's environment, working directory and
arguments, sys.path[0] set as the interpreter sets it, the script run as `__main__`, stdout and stderr to the
files, an exception's traceback printed and status 1, interpreter exit as usual (atexit handlers run). What it
cannot give: a library imported here read its environment variables at import (JAX's `JAX_*` options), so a
command that sets JAX_* variables of its own should not come here (XLA_FLAGS is read later, when a backend is made,
and may differ per command). Nothing here starts a JAX backend or a thread, so forking is safe.
"""

import json
import os
import runpy
import signal
import sys
import tempfile
import time

PRELOAD = ("numpy", "jax", "jax.numpy", "flax.nnx", "optax", "orbax.checkpoint", "grain", "ml_collections", "PIL")


def _child(req: dict) -> None:
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    tempfile.tempdir = None  # TMPDIR from the request's environment
    sys.dont_write_bytecode = bool(req["env"].get("PYTHONDONTWRITEBYTECODE"))
    argv = req["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


def _wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -9
        time.sleep(0.02)


def main() -> None:
    for name in PRELOAD:
        __import__(name)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)  # ends the child: the loop below is the parent's only
        print(json.dumps({"code": _wait(pid, req["timeout"])}), flush=True)


if __name__ == "__main__":
    main()
