"""The package's modules stand in layers, each importing only from its own layer or those
below: shared facts -> engine -> service -> daemon -> tools. Every import of every module is
read (the AST: imports inside functions included) and checked against :data:`LAYERS`; an
import of a higher layer, or a circle of imports (even within one layer), fails, and so does
a module the map does not place. No module may be over :data:`MAX_LINES` lines."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "moecached"

#: lowest first; a name is a module of the package (``tools.*``: every module under tools/)
LAYERS = {
    "facts": ["moecached", "facts", "facts.*"],
    "engine": ["engine", "engine.*"],
    "service": ["service", "service.*"],
    "daemon": ["daemon", "daemon.*"],
    "tools": ["tools", "tools.*"],
}
#: import circles allowed for now: none
KNOWN_CIRCLES: list = []
#: the most lines a module may have: every .py under moecached/, every .pyx and .pxd under
#: cython_ext/ (the generated .c files aside)
MAX_LINES = 700


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict:
    """Module name -> source path, for the package's Python files and its Cython extensions
    (built from cython_ext/<wing>/*.pyx into the wing's package)."""
    mods = {_module_name(p): p for p in PKG.rglob("*.py")}
    for p in (ROOT / "cython_ext").glob("*/*.pyx"):
        mods[f"moecached.{p.parent.name}.{p.stem}"] = p
    return mods


def _imports(name: str, path: Path, mods: dict) -> list:
    """(line, imported module of the package) for every import in ``path``."""
    out = []
    if path.suffix == ".pyx":   # Cython: the plain Python import lines
        for i, line in enumerate(path.read_text().splitlines(), 1):
            m = re.match(r"\s*(?:from|import)\s+(moecached(?:\.\w+)*)", line)
            if m:
                out.append((i, m.group(1)))
        return out
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = pkg.split(".")[:len(pkg.split(".")) - (n.level - 1)]
                mod = ".".join(base + ([n.module] if n.module else []))
            else:
                mod = n.module or ""
            for a in n.names:   # `from . import x` imports the module x when there is one
                full = f"{mod}.{a.name}"
                out.append((n.lineno, full if full in mods else mod))
        elif isinstance(n, ast.Import):
            out += [(n.lineno, a.name) for a in n.names]
    return [(i, m) for i, m in out if m == "moecached" or m.startswith("moecached.")]


def _layer_of(name: str):
    short = name[len("moecached."):] if name != "moecached" else "moecached"
    for rank, (layer, names) in enumerate(LAYERS.items()):
        for pat in names:
            if short == pat or (pat.endswith(".*") and short.startswith(pat[:-1])):
                return rank, layer
    return None


def _graph():
    mods = _modules()
    edges = {}
    for name, path in mods.items():
        for line, target in _imports(name, path, mods):
            while target not in mods and "." in target:   # a name inside a module
                target = target.rsplit(".", 1)[0]
            if target != name:
                edges.setdefault(name, {}).setdefault(target, line)
    return mods, edges


def _circles(nodes, edges) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
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

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    mods, _ = _graph()
    assert not [m for m in mods if _layer_of(m) is None], \
        "modules the layer map does not place: add them to LAYERS"


def test_no_module_imports_a_higher_layer():
    mods, edges = _graph()
    bad = []
    for src, targets in edges.items():
        for dst, line in targets.items():
            (a, la), (b, lb) = _layer_of(src), _layer_of(dst)
            if b > a:
                bad.append(f"{mods[src].relative_to(ROOT)}:{line}: {src} ({la}) imports "
                           f"{dst} ({lb})")
    assert not bad, "imports of a higher layer:\n" + "\n".join(sorted(bad))


def test_no_import_circles():
    mods, edges = _graph()
    found = [c for c in _circles(mods, edges) if c not in KNOWN_CIRCLES]
    assert not found, f"import circles: {found}"


def test_the_checker_sees_function_level_imports(tmp_path):
    """The reader finds imports inside functions and relative ones, and the circle finder
    finds a circle (the test's own tools work)."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from .cache import ExpertCache\n    from ..service import server\n")
    mods = {"moecached.engine.cache": None, "moecached.service.server": None}
    got = _imports("moecached.engine.m", src, mods)
    assert got == [(2, "moecached.engine.cache"), (3, "moecached.service.server")]
    assert _circles(["a", "b", "c"], {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == [["a", "b", "c"]]
    assert _circles(["a", "b"], {"a": {"b": 1}}) == []


def _sizes() -> dict:
    """Source path (relative to the checkout) -> lines, for every module the limit covers."""
    client = ROOT / "clients" / "python" / "moecache_client"
    files = [*PKG.rglob("*.py"), *(ROOT / "cython_ext").rglob("*.pyx"),
             *(ROOT / "cython_ext").rglob("*.pxd"), *client.glob("*.py"), *client.glob("*.pyx")]
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}


def test_no_module_is_over_the_line_limit():
    """The largest module has at most MAX_LINES lines; the message names every one over."""
    over = sorted(((n, p) for p, n in _sizes().items() if n > MAX_LINES), reverse=True)
    assert not over, (f"modules over {MAX_LINES} lines (split them): "
                      + ", ".join(f"{p} ({n})" for n, p in over))
