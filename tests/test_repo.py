"""The repository stands alone: nothing in it points outside it, the library never imports the configs folder,
and the scripts import the installed package without editing sys.path."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Files of the workplace this project grew in; the facts the project uses from them live in docs/recipe.md.
OUTSIDE = re.compile(r"\.\./shared|\b(RECIPE|PITFALLS|STYLE)\.md\b")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in out.splitlines() if (ROOT / f).is_file()]


def test_nothing_refers_outside_the_repository():
    hits = []
    for path in _tracked():
        if path.suffix in (".png", ".npz") or path == Path(__file__).resolve():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)


def test_library_does_not_import_configs_and_scripts_do_not_edit_sys_path():
    imports_configs = re.compile(r"^\s*(from|import) configs\b", re.M)
    lib = [p for p in (ROOT / "reve_jax").rglob("*.py") if imports_configs.search(p.read_text())]
    assert not lib, f"the library imports configs/: {lib}"
    scripts = [p.name for p in (ROOT / "scripts").glob("*.py") if "sys.path" in p.read_text()]
    assert not scripts, f"scripts editing sys.path: {scripts}"


# ---------------------------------------------------------------------------------------------- import rules
def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """reve_jax module -> the reve_jax modules it names in an import, at the top or inside a function (a
    function-level import is a dependency too). `from a.b import c` depends on the module a.b.c where there is one,
    else on a.b (the implicit run of a package's __init__ is left out: a package may re-export its modules)."""
    import ast

    modules = {_module_name(p): p for p in (ROOT / "reve_jax").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]  # fmt: skip
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t.startswith("reve_jax") and t != name:
                    deps.add(t)
        graph[name] = deps - {"reve_jax"}
    return graph


def test_the_training_system_never_imports_the_study():
    graph = _import_graph()
    bad = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if not m.startswith("reve_jax.speedup")
        for d in deps
        if d.startswith("reve_jax.speedup")
    )
    assert not bad, "the core imports the speedup study:\n" + "\n".join(bad)


def test_the_model_imports_only_the_model():
    graph = _import_graph()
    bad = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m.startswith("reve_jax.model")
        for d in deps
        if not d.startswith("reve_jax.model")
    )
    assert not bad, "model/ imports outside model/ (pass the value in instead):\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles between modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not _cycles({"a": {"b"}, "b": set()})
