"""Every command that README.md and docs/*.md show runs as written, in a quick form.

Which commands. In README.md and docs/*.md: every line of a fenced code block whose info string is empty or a
shell (bash, sh, shell, console; not ```python), every line of an indented code block, and every inline code
span (a span may wrap lines within its paragraph). Backslash-continued lines are joined and `# ...` comments
dropped (shell rules, shlex). A line or span is a chain split at `&&`, `||`, `;` and `|`; each part that is
`[VAR=value ...] python scripts/<name>.py ...`, `python -m <module> ...` or `bash scripts/<name> ...` is a
command, named by the file and the line it starts on (`docs/data.md:22`).

Placeholders. Optional parts `[--opt value ...]` are unwrapped: the documented option runs, and `...` is
dropped. Of alternatives `a|b` or `{a,b}` the first runs. A command with a metavariable (an upper-case word such
as `C`, `W`, `B`, or `<name>`) is a usage synopsis, not a command: it is reported as skipped. Paths the docs use
for the reader's own files (`path/to/images`, `/data/photos`, `vgg16-397923af.pth`) are kept: see Paths.

Quick form. QUICK maps each script (or module) to what is added to the command: `--dry-run` (the script checks
its arguments, config, inputs and mesh and prints one `dry run:` line), else PARSE for what needs hosts, a
cluster or minutes of work: the command runs through tests/parse_only.py, which stops it once its arguments are
parsed (and its config loaded with its overrides), so an unknown option or config key still fails it (`--help`
would not: argparse prints the help before it looks at the other arguments). A command whose script has no entry
fails, saying to add one.

Paths. Every argument value that looks like a path (has a `/` or a file suffix) and does not exist in the
repository is moved under the test's temporary directory, so no command writes into the repository (the value
of `--config`, a config file, is never moved: it must exist, except `configs/x.py`, the docs' name for the
reader's own config, which runs as configs/tiny.py). Of those, the values of the options a QUICK entry
lists as `inputs` ("" for positional arguments) and of every `--config.*path=` override are the reader's input
files: an empty file (or a folder, for a value without a suffix) is made there; `runs` options name a finished
run: a workdir holding one checkpoint of configs/tiny.py's config is put there (the dry runs read its config).

Each command runs in its own process from the repository root, on the CPU with 8 emulated devices, with a hard
timeout; the commands run two at a time (a session-wide pool) and each test waits for its own. A Python command
is forked from tests/zygote.py, which has imported the heavy libraries once (its docstring says what that changes).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import json
import os
import queue
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from util import xla_flags

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 150
WORKERS = 2


@dataclasses.dataclass(frozen=True)
class Quick:
    args: tuple[str, ...] = ("--dry-run",)  # appended to the documented arguments
    expect: str = "dry run: "  # the output must contain this
    inputs: tuple[str, ...] = ()  # options whose paths are the reader's files ("" = positional arguments)
    runs: tuple[str, ...] = ()  # options naming a finished run's workdir
    before: tuple[str, ...] = ()  # interpreter options, before the script
    parse_only: bool = False  # run through tests/parse_only.py: stop once the arguments are parsed


PARSE = Quick((), "arguments parsed: ", parse_only=True)
# One entry per script or module; "<script> <flag>" is the entry for that script's commands that carry <flag>.
# PARSE entries say why the command cannot run here in a quick form.
QUICK = {
    "scripts/train.py": Quick(),
    "scripts/sample.py": Quick(runs=("--workdir",)),
    "scripts/convert_checkpoint.py": Quick(runs=("--workdir",)),
    "scripts/plan.py": Quick(),
    "scripts/simulate_cluster.py": Quick(),
    "scripts/prepare_data.py": Quick(inputs=("",)),
    "scripts/convert_weights.py": Quick(inputs=("--vgg", "--lin", "--src")),
    "scripts/bench_throughput.py": Quick(),
    "scripts/bench_host.py": Quick(),
    "scripts/bench_speedup.py": Quick(),
    "scripts/bench_speedup.py --rescore": Quick(inputs=("--out",)),
    "scripts/bench_speedup.py --trend": Quick(inputs=("--trend", "")),
    "scripts/launch.py": PARSE,  # supervises training processes on hosts or a SLURM allocation
    "scripts/bench_recovery.py": PARSE,  # a 4-host elastic run with a kill: a minute or more
    "scripts/bench_snapshot.py": Quick(),  # 4-host runs with and without snapshots: minutes
    "scripts/evaluate.py": PARSE,  # samples hundreds of images from a run and scores them
    "scripts/train_autoencoder.py": PARSE,  # trains an autoencoder (minutes); has no --dry-run yet
    "scripts/device_bench.sh": Quick((), "", before=("-n",)),  # the GPU rows (SMOKE=1: minutes on a CPU): syntax
    "pytest": Quick(("--collect-only", "-p", "no:cacheprovider"), "tests collected"),  # the suite: collected
    "reve_jax.elastic.probe": Quick((), ""),  # a matmul on each device: runs as is
    # compiles the train step for another group size; the docs name it, the supervisor runs it with a config
    "reve_jax.elastic.precompile": dataclasses.replace(PARSE, args=("--config", "configs/tiny.py")),
    "reve_jax.tools.bench.perceptual": PARSE,  # compiles both perceptual losses: about a minute on a CPU
    "reve_jax.speedup.figures": PARSE,  # renders and reads thousands of images: minutes
    "reve_jax.perceptual.build_shapes": PARSE,  # trains the evaluation feature net: most of an hour
}

# ----------------------------------------------------------------------------------------------- Extraction
SHELL_FENCES = ("", "bash", "sh", "shell", "console")
SEPARATORS = ("&&", "||", ";", "|")
ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
STARTS = re.compile(r"(?:^|&&|\|\|?|;)\s*(?:\w+=(?:\"[^\"]*\"|'[^']*'|\S+)\s+)*(?:python3?|bash)\s+(?:scripts/|-m\s)")
METAVAR = re.compile(r"[A-Z][A-Z0-9_]*|<[^>]+>")
FILE_SUFFIX = re.compile(r"[\w.-]*\.[A-Za-z]\w*")


@dataclasses.dataclass(frozen=True)
class Command:
    where: str  # "docs/data.md:22": the line it starts on
    env: tuple[tuple[str, str], ...]  # VAR=value prefixes
    argv: tuple[str, ...]  # as documented, placeholders resolved (module docstring)
    key: str  # "scripts/train.py", "scripts/device_bench.sh", or a module name ("pytest")
    synopsis: str = ""  # the metavariable that makes it a usage synopsis

    def __str__(self):
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env), shlex.join(self.argv)])


def _joined(lines: list[str], i: int) -> tuple[str, int]:
    """Line i with its backslash continuations joined; and the index of its last line."""
    line = lines[i]
    while line.rstrip().endswith("\\") and i + 1 < len(lines):
        i += 1
        line = line.rstrip()[:-1] + " " + lines[i].strip()
    return line.strip(), i


def snippets(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every code line and inline code span of a Markdown text."""
    lines, out, para, fence, i = text.splitlines(), [], [], None, 0
    while i < len(lines):
        line, number = lines[i], i + 1
        if fence is not None:
            if line.strip().startswith(fence[0]):
                fence = None
            elif fence[1] in SHELL_FENCES:
                code, i = _joined(lines, i)
                out.append((number, code))
        elif m := re.match(r"\s*(```+|~~~+)\s*(\w*)", line):
            out += inline_spans(para)
            para, fence = [], (m.group(1), m.group(2).lower())
        elif line.startswith("    ") and not para:  # an indented block starts after a blank line
            code, i = _joined(lines, i)
            out.append((number, code))
        elif not line.strip():
            out += inline_spans(para)
            para = []
        else:
            para.append((number, line))
        i += 1
    return out + inline_spans(para)


def inline_spans(para: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The code spans of one paragraph; newlines inside a span are spaces, as Markdown renders them."""
    text, offsets, pos = "", [], 0
    for number, line in para:
        offsets.append((pos, number))
        text += line + "\n"
        pos += len(line) + 1
    out = []
    for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.S):
        number = max((o for o in offsets if o[0] <= m.start()), default=(0, 0))[1]
        out.append((number, " ".join(m.group(2).split())))
    return out


def resolve(tokens: list[str]) -> tuple[list[str], str]:
    """Unwrap `[...]`, drop `...`, take the first alternative; return the tokens and the first metavariable."""
    out, synopsis = [], ""
    for tok in tokens:
        if tok.startswith("[-"):
            tok = tok[1:]
        if tok.endswith("]") and tok.count("[") < tok.count("]"):
            tok = tok[:-1]
        if tok in ("", "...", "…"):
            continue
        head, value = _split(tok)
        if alt := re.fullmatch(r"\{([^{},]+),[^{}]*\}", value):
            value = alt.group(1)
        elif "|" in value:
            value = value.split("|")[0]
        if not synopsis and METAVAR.fullmatch(value):
            synopsis = value
        out.append(head + value)
    return out, synopsis


def _split(tok: str) -> tuple[str, str]:
    """`--opt=value` -> ("--opt=", "value"); an option without `=` has no value; a plain word is all value."""
    if tok.startswith("-"):
        name, eq, value = tok.partition("=")
        return (name + eq, value) if eq else (tok, "")
    return "", tok


def parse(where: str, text: str) -> list[Command]:
    if not STARTS.search(text):
        return []
    tokens = shlex.split(text, comments=True)
    parts, current = [], []
    for tok in tokens:
        if tok in SEPARATORS:
            parts.append(current)
            current = []
        else:
            current.append(tok)
    commands = []
    for part in [*parts, current]:
        env = []
        while part and ENV.match(part[0]):
            env.append(tuple(part[0].split("=", 1)))
            part = part[1:]
        if len(part) < 2 or part[0] not in ("python", "python3", "bash"):
            continue
        if part[0] == "bash" or (part[1].startswith("scripts/") and part[1].endswith(".py")):
            key = part[1]
        elif part[1] == "-m" and len(part) > 2:
            key = part[2]
        else:
            continue
        argv, synopsis = resolve(part)
        commands.append(Command(where, tuple(env), tuple(argv), key, synopsis))
    return commands


def find_commands(files=None) -> list[Command]:
    """Every command of README.md and docs/*.md in file order; a second one on a line gets `#2`."""
    files = files or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    commands, seen = [], {}
    for path in files:
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
        for number, text in snippets(path.read_text()):
            for c in parse(f"{rel}:{number}", text):
                seen[c.where] = seen.get(c.where, 0) + 1
                if seen[c.where] > 1:
                    c = dataclasses.replace(c, where=f"{c.where}#{seen[c.where]}")
                commands.append(c)
    return commands


def quick_for(c: Command) -> Quick | None:
    modes = [QUICK[f"{c.key} {a}"] for a in c.argv if f"{c.key} {a}" in QUICK]
    return modes[0] if modes else QUICK.get(c.key)


# ---------------------------------------------------------------------------------------------- Running
READER_CONFIGS = {"configs/x.py": "configs/tiny.py"}  # a config file the docs name for the reader's own


def saved_run(path: Path) -> Path:
    """A workdir with one checkpoint whose metadata holds configs/tiny.py's config; the state is a stand-in (the
    dry runs of sample.py and convert_checkpoint.py read the config, not the weights)."""
    import jax.numpy as jnp

    from reve_jax import checkpoint, config

    ckpt = checkpoint.Checkpointer(path, async_save=False)
    ckpt.save(1, {"step": jnp.zeros((), jnp.int32)}, {"config": config.to_json(config.load_config("configs/tiny.py"))})
    ckpt.close()
    return path


def quick_argv(c: Command, q: Quick, tmp: Path, run: Path | None) -> list[str]:
    """The command's argv with its paths moved under `tmp`, inputs and runs made there, and the quick form."""
    argv, after = [], None
    for i, tok in enumerate(c.argv):
        head, value = _split(tok)
        option = head.rstrip("=") if head else (after or "")
        after = tok if tok.startswith("-") and not value and "=" not in tok else None
        if option == "--config" and value in READER_CONFIGS:
            argv.append(head + READER_CONFIGS[value])
            continue
        if i < (3 if c.argv[1] == "-m" else 2) or option == "--config" or not _is_path(value):
            argv.append(tok)
            continue
        moved = tmp / value.lstrip("/")
        if option in q.runs:
            shutil.copytree(run, moved)
        elif option in q.inputs or re.fullmatch(r"--config\.\S*path", option):
            stub = Path(str(moved).replace("*", "0"))
            if value.endswith("/") or not FILE_SUFFIX.fullmatch(stub.name):
                stub.mkdir(parents=True, exist_ok=True)
            else:
                stub.parent.mkdir(parents=True, exist_ok=True)
                stub.touch()
        if any(ch in value for ch in "*?["):  # the shell would expand it
            argv += [head + p for p in sorted(glob.glob(str(moved)))]
        else:
            argv.append(head + str(moved) + ("/" if value.endswith("/") else ""))
    program = [sys.executable] if argv[0].startswith("python") else [argv[0]]
    if q.parse_only:
        program.append(str(ROOT / "tests" / "parse_only.py"))
    return [*program, *q.before, *argv[1:], *q.args]


def _is_path(value: str) -> bool:
    if not value or " " in value or (ROOT / value).exists():
        return False
    return "/" in value or bool(FILE_SUFFIX.fullmatch(value))


class Zygote:
    """tests/zygote.py: forks a command with the heavy libraries already imported (its docstring)."""

    def __init__(self):
        argv = [sys.executable, str(ROOT / "tests" / "zygote.py")]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def run(self, argv: list[str], env: dict, tmp: Path, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
        out, err = tmp / "zygote.out", tmp / "zygote.err"
        req = dict(argv=argv[1:], env=env, cwd=str(ROOT), out=str(out), err=str(err), timeout=timeout)
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, "the zygote died"
        code = json.loads(reply)["code"]
        errors = err.read_text(errors="replace") + (f"timed out after {timeout} s" if code == -9 else "")
        return subprocess.CompletedProcess(argv, code, out.read_text(errors="replace"), errors)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def _forks(argv: list[str], env_of_command: dict) -> bool:
    """Whether the zygote can run it: a Python script or module other than pytest, without JAX options of its own
    (the zygote's JAX read its options when it was imported)."""
    own_jax = any(k.startswith("JAX") for k in env_of_command)
    return argv[0] == sys.executable and "pytest" not in argv[1:3] and not own_jax


def run_command(
    c: Command, q: Quick, tmp: Path, run: Path | None, zygotes: queue.Queue
) -> tuple[list[str], subprocess.CompletedProcess]:
    argv = quick_argv(c, q, tmp, run)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(c.env)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{dict(c.env).get('XLA_FLAGS', '')} {xla_flags(8)}".strip(),
        PYTHONDONTWRITEBYTECODE="1",
        TMPDIR=str(tmp),
    )
    if _forks(argv, dict(c.env)):
        zygote = zygotes.get()
        try:
            return argv, zygote.run(argv, env, tmp)
        finally:
            zygotes.put(zygote)
    try:
        proc = subprocess.run(
            argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        proc = subprocess.CompletedProcess(argv, -9, out, f"timed out after {TIMEOUT_S} s")
    return argv, proc


COMMANDS = find_commands()


@pytest.fixture(scope="session")
def started(request, tmp_path_factory):
    """Starts every selected command in a pool of WORKERS threads, each running one subprocess; {where: future}."""
    chosen = [
        item.callspec.params["command"]
        for item in request.session.items
        if item.path == Path(__file__) and getattr(item, "originalname", "") == "test_doc_command"
        and not item.get_closest_marker("skip")
    ]  # fmt: skip
    jobs = {str(c): (c, quick_for(c)) for c in chosen if quick_for(c) is not None}  # a repeated command runs once
    run = saved_run(tmp_path_factory.mktemp("saved_run")) if any(q.runs for _, q in jobs.values()) else None
    tmps = {text: tmp_path_factory.mktemp("cmd") for text in jobs}
    zygotes = queue.Queue()
    for _ in range(WORKERS if jobs else 0):
        zygotes.put(Zygote())
    pool = concurrent.futures.ThreadPoolExecutor(WORKERS)
    try:
        futures = {text: pool.submit(run_command, c, q, tmps[text], run, zygotes) for text, (c, q) in jobs.items()}
        yield {c.where: futures[str(c)] for c in chosen if str(c) in futures}
    finally:
        pool.shutdown(cancel_futures=True)  # after -x or Ctrl-C, the commands not yet started are dropped
        while not zygotes.empty():
            zygotes.get().close()


def _param(c: Command):
    if c.synopsis:
        return pytest.param(c, id=c.where, marks=pytest.mark.skip(reason=f"usage synopsis ({c.synopsis})"))
    return pytest.param(c, id=c.where)


@pytest.mark.parametrize("command", [_param(c) for c in COMMANDS])
def test_doc_command(command: Command, started):
    q = quick_for(command)
    assert q is not None, (
        f"{command.where}: `{command}` runs {command.key}, which has no quick form: add an entry to QUICK in "
        f"tests/test_docs_commands.py (--dry-run if the script has one, else --help)"
    )
    argv, proc = started[command.where].result()
    out = proc.stdout + proc.stderr
    expect = "usage:" if {"-h", "--help"} & set(command.argv) else q.expect  # the docs show the help
    assert proc.returncode == 0 and expect in out, (
        f"{command.where}: `{command}` failed in its quick form\n  ran: {shlex.join(argv)}\n"
        f"  exit status {proc.returncode}, output (last 3000 characters):\n{out[-3000:]}"
    )


def test_every_command_has_a_quick_form():
    missing = sorted({c.key for c in COMMANDS if quick_for(c) is None})
    assert not missing, f"no QUICK entry in tests/test_docs_commands.py for {missing}: add one"


def test_extraction_rules(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Title\n\n"
        "    pip install x && python scripts/a.py --config configs/tiny.py   # a comment\n\n"
        "```bash\n"
        "python scripts/b.py --x 1 \\\n"
        "    --y 2 [--z path/to/f.pth ...]\n"
        "```\n\n"
        "```python\n"
        "python scripts/never.py\n"
        "```\n\n"
        "Prose with `python scripts/c.py --size cpu|gpu --k\n"
        '{p,q}` and `XLA_FLAGS="-a -b" python -m pkg.mod -v`, `scripts/d.py` and\n'
        "`python scripts/e.py --config C`.\n"
    )
    got = [(c.where, c.key, c.argv[1:], c.env, c.synopsis) for c in find_commands([doc])]
    assert got == [
        ("doc.md:3", "scripts/a.py", ("scripts/a.py", "--config", "configs/tiny.py"), (), ""),
        ("doc.md:6", "scripts/b.py", ("scripts/b.py", "--x", "1", "--y", "2", "--z", "path/to/f.pth"), (), ""),
        ("doc.md:14", "scripts/c.py", ("scripts/c.py", "--size", "cpu", "--k", "p"), (), ""),
        ("doc.md:15", "pkg.mod", ("-m", "pkg.mod", "-v"), (("XLA_FLAGS", "-a -b"),), ""),
        ("doc.md:16", "scripts/e.py", ("scripts/e.py", "--config", "C"), (), "C"),
    ]


@pytest.mark.parametrize(
    "argv, why",
    [
        (["scripts/launch.py", "--config", "configs/tiny.py", "--workdir", "w", "--hosts", "2", "--bogus"], "bogus"),
        (
            [
                "scripts/launch.py",
                "--config",
                "configs/tiny.py",
                "--workdir",
                "w",
                "--hosts",
                "2",
                "--config.model.nope=1",
            ],
            "nope",
        ),
        (["-m", "reve_jax.elastic.precompile", "--config", "configs/tiny.py", "--config.train.steps=x"], "steps"),
    ],
)
def test_parse_only_rejects_an_unknown_option_or_config_key(argv, why):
    """The PARSE form (tests/parse_only.py) fails a command with an unknown option or a bad override, where
    `--help` would have printed the usage and exited 0; a good command passes it."""
    run = [sys.executable, str(ROOT / "tests" / "parse_only.py")]
    bad = subprocess.run([*run, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and why in bad.stderr, (bad.returncode, bad.stdout[-2000:], bad.stderr[-2000:])
    good = [a for a in argv if a not in ("--bogus", "--config.model.nope=1", "--config.train.steps=x")]
    ok = subprocess.run([*run, *good], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "arguments parsed: " in ok.stdout, (ok.stdout[-2000:], ok.stderr[-2000:])


def test_the_zygote_runs_a_command_as_its_own_process_would(tmp_path):
    """A forked command gets its arguments, environment and working directory, its output and exit status come
    back, an unknown config key fails it as the script's own process would, and a hung one is killed."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(8), TMPDIR=str(tmp_path), REVE_PROBE="seen")
    train = [sys.executable, "scripts/train.py", "--config", "configs/tiny.py", "--workdir", str(tmp_path / "w")]
    probe = tmp_path / "probe.py"
    probe.write_text("import os, sys, tempfile\nprint(os.environ['REVE_PROBE'], tempfile.gettempdir(), sys.argv[1:])\n")
    zygote = Zygote()
    try:
        good = zygote.run([*train, "--dry-run"], env, tmp_path)
        assert good.returncode == 0 and "dry run: " in good.stdout + good.stderr, good
        bad = zygote.run([*train, "--config.model.nope=1", "--dry-run"], env, tmp_path)
        assert bad.returncode != 0 and "nope" in bad.stderr and "dry run: " not in bad.stdout, bad
        seen = zygote.run([sys.executable, str(probe), "a b"], env, tmp_path)
        assert seen.returncode == 0 and seen.stdout.strip() == f"seen {tmp_path} ['a b']", seen
        hang = tmp_path / "hang.py"
        hang.write_text("import time\ntime.sleep(600)\n")
        hung = zygote.run([sys.executable, str(hang)], env, tmp_path, timeout=1)
        assert hung.returncode == -9 and "timed out" in hung.stderr
    finally:
        zygote.close()
