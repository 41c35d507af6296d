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
