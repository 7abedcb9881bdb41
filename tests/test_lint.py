"""The code passes the linter configured in pyproject.toml ([tool.ruff]); CI runs this."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed (pip install -e '.[test]' installs it)")
    r = subprocess.run([ruff, "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_core_never_imports_tools():
    """The daemon core (moecached/<wing>/*.py, cython_ext/<wing>/*.pyx) is library code under the tools:
    nothing in it imports moecached.tools (the tools import the core, never the reverse)."""
    import ast
    import re
    bad = []
    core = [f for f in (ROOT / "moecached").rglob("*.py") if "tools" not in f.relative_to(ROOT).parts]
    for f in sorted(core):
        for n in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(n, ast.ImportFrom):
                mod = "." * n.level + (n.module or "")
                names = [mod] + [f"{mod}.{a.name}" if n.module else f"{mod}{a.name}" for a in n.names]
            elif isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            if any(re.fullmatch(r"(moecached|\.)\.?tools(\..*)?", m) for m in names):
                bad.append(f"{f.relative_to(ROOT)}:{n.lineno}")
    for f in sorted((ROOT / "cython_ext").glob("**/*.pyx")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if re.match(r"\s*(from|import)\s+(moecached\.)?tools\b", line):
                bad.append(f"{f.relative_to(ROOT)}:{i}")
    assert not bad, f"core modules import moecached.tools: {bad}"


def test_readme_map_names_every_module():
    """README's "What is where" names every module of the daemon, its tools and its Cython
    sources (by path, or by file name after a path in its folder), and every path it names
    exists."""
    import re
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## What is where"):]
    table = table[:table.index("\n## ")]
    named = set(re.findall(r"`([^`\s]+)`", table))
    files = sorted([*(ROOT / "moecached").rglob("*.py"),
                    *(ROOT / "cython_ext").glob("**/*.pyx")])
    missing = [str(f.relative_to(ROOT)) for f in files if f.name != "__init__.py"
               and str(f.relative_to(ROOT)) not in named and f.name not in named]
    assert not missing, f"README.md's map of the code does not name {missing}"
    gone = [n for n in named if "/" in n and not n.startswith(("ipc:", "http")) and not (ROOT / n).exists()]
    assert not gone, f"README.md's map names paths that do not exist: {gone}"


def test_every_package_of_the_daemon_is_installed():
    """``pip install .`` (not editable) ships every package under moecached/: the wings are
    listed in pyproject.toml's ``packages``, and a new one must be too."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "moecached").rglob("__init__.py")}
    assert found == listed, f"pyproject.toml packages: missing {sorted(found - listed)}, stale {sorted(listed - found)}"
