"""Test setup: makes tests/ importable (``from fixtures import make_model``) and offers the
session-scoped ``model_factory`` fixture: ``model_factory(layout_name, layers=4, experts=8,
split=None, legacy=False, seed=0) -> path`` (see tests/fixtures.py).

Disk: the models ``make_model`` wrote are deleted when the session ends (passed or not), and
``tmp_path_retention_policy = "failed"`` (pyproject.toml) has pytest delete the ``tmp_path`` of
every passing test, so a run leaves only what failing tests wrote.

Tiers: every test is sorted at collection (``pytest_collection_modifyitems``) into the heavy
kinds it belongs to, as markers (registered in pyproject.toml):

- ``daemon``: starts ``moecached`` processes -- uses ``start_daemon`` or the ``daemon_procs``
  fixture, or runs ``python -m moecached...`` (the daemon, or ``moecache-ctl``) as a process;
- ``build``: compiles (``make``, ``cc``: the C client);
- ``engine``: runs the patched llama.cpp (``engine_llama``);
- ``slow``: memory pressure (``memory_hog``, ``HOG``), the soaks (``test_soak*.py``), and the
  in-process tests marked ``@pytest.mark.slow`` by hand because they take seconds.

The first three are found in the test's source, the sources of the fixtures it uses and of the
test module's own helpers, classes and constants it names (transitively), so a new test is
sorted without anyone marking it. Every other test gets ``fast``: ``pytest -m fast`` is the
inner loop (README.md). A test that starts a daemon process or a build without carrying its
marker fails at once, naming itself (the tripwire around ``subprocess.Popen`` below), so the
sorting cannot silently rot; tests/test_tiers.py checks the fast tier from the outside."""
import ast
import functools
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import make_model, remove_models  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    remove_models()


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe-models")

    def make(layout_name, **kw):
        return make_model(base, layout_name, **kw)

    return make


@pytest.fixture(scope="module", params=["hot_path_on", "hot_path_off"])
def hot_path(request):
    """Runs a module twice: every Server built in it (in-process, or a daemon a test starts,
    which inherits the environment) with the Cython hot path on, then off
    (``MOECACHED_HOT_PATH=0``: everything takes ``Server._handle``). The value is True when on.
    Server-facing modules use it for the whole module::

        pytestmark = pytest.mark.usefixtures("hot_path")
    """
    from moecached.service.server import HOT_PATH_ENV
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(HOT_PATH_ENV, "1" if request.param == "hot_path_on" else "0")
        yield request.param == "hot_path_on"


@pytest.fixture
def daemon_procs(model, tmp_path):
    """Real ``moecached`` processes on the test module's ``model`` fixture, arena files in the
    test's tmp dir: ``start(*args, sock=None) -> (endpoint, Popen)``; ``sock`` names the socket
    file (by default a new one per start; the same name again is a restart at one endpoint).
    At teardown each is stopped and its output checked for a traceback."""
    from daemon_util import start_daemon, stop_daemon
    procs = []

    def start(*args, sock=None):
        path = str(tmp_path / (sock or f"d{len(procs)}.sock"))
        procs.append(start_daemon(str(model), path, "--arena-dir", str(tmp_path), *args))
        return f"ipc://{path}", procs[-1]
    yield start
    for p in procs:
        out = stop_daemon(p)
        assert "Traceback" not in out, out


# ---- tiers ---------------------------------------------------------------------------------

HEAVY = ("daemon", "build", "engine", "slow")
#: what in a test's source (or in what it uses) puts it in a heavy kind
KIND_PATTERNS = {
    "daemon": re.compile(r"\bstart_daemon\b|\bdaemon_procs\b|[\"']-m[\"'],\s*[\"']moecached\b|"
                         r"\btools\.demo import [\w, ]*\b(Daemon|engine_step)\b"),   # the demo's daemon process
    "build": re.compile(r"[\"'](?:make|cc|c\+\+|cmake)[\"']|\bbuild\.sh\b|\bshm_shim\b"),   # shm_shim compiles
    "engine": re.compile(r"\bengine_llama\b|\bllama_bin\b|\bengine_step\b"),
    "slow": re.compile(r"\bmemory_hog\b|\bHOG\b"),
}
_IDENT = re.compile(r"\b[A-Za-z_]\w*\b")


@functools.lru_cache(maxsize=None)
def _module_defs(path: str) -> dict:
    """Top-level functions, classes, assignments and ``from`` imports of a module: name -> source
    text (for an import, the one name's ``from X import name``)."""
    try:
        text = Path(path).read_text()
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return {}
    defs = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:   # a name stands for where it comes from
            for a in node.names:
                defs[a.asname or a.name] = f"from {node.module} import {a.name}"
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
        else:
            continue
        seg = ast.get_source_segment(text, node) or ""
        for n in names:
            if n != "pytestmark":
                defs[n] = defs.get(n, "") + "\n" + seg
    return defs


def _kinds_in(src: str, path: str, seen: set) -> set:
    """Heavy kinds in ``src`` and in the helpers of module ``path`` that it names, transitively."""
    kinds = {k for k, rx in KIND_PATTERNS.items() if rx.search(src)}
    defs = _module_defs(path)
    for name in set(_IDENT.findall(src)) & defs.keys():
        if (path, name) not in seen:
            seen.add((path, name))
            text, where = defs[name], path
            m = re.fullmatch(r"from (\w+) import (\w+)", text)
            helper = Path(path).parent / f"{m.group(1)}.py" if m else None
            if helper is not None and helper.is_file():   # a helper module beside the tests
                where = str(helper)
                text = _module_defs(where).get(m.group(2), "")
            kinds |= _kinds_in(text, where, seen)
    return kinds


def _source(func) -> tuple[str, str]:
    try:
        return inspect.getsource(func), inspect.getsourcefile(inspect.unwrap(func)) or ""
    except (OSError, TypeError):
        return "", ""


def heavy_kinds(item) -> set:
    """The heavy kinds of a collected test, from its source and its fixtures'."""
    kinds = {k for k in HEAVY if item.get_closest_marker(k)}
    if Path(str(item.fspath)).name.startswith("test_soak"):
        kinds.add("slow")
    func = getattr(item, "function", None)
    if func is None:
        return kinds
    seen: set = set()
    funcs = [func]
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        defs = info.name2fixturedefs.get(name) if info else None
        if defs:
            funcs.append(defs[-1].func)
    for f in funcs:
        src, path = _source(f)
        kinds |= _kinds_in(src, path, seen)
    return kinds


@pytest.hookimpl(tryfirst=True)   # before -m deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        kinds = heavy_kinds(item)
        for k in sorted(kinds):
            if not item.get_closest_marker(k):
                item.add_marker(k)
        if not kinds:
            item.add_marker("fast")


def pytest_collection_finish(session):
    """``MOECACHED_TIERS_DUMP=FILE``: write what was selected (node id, fixtures, markers) as
    JSON, for tests/test_tiers.py."""
    out = os.environ.get("MOECACHED_TIERS_DUMP")
    if out:
        rows = [{"id": it.nodeid, "fixtures": list(getattr(it, "fixturenames", ())),
                 "markers": sorted({m.name for m in it.iter_markers()}),
                 "source": _source(it.function)[0] if hasattr(it, "function") else ""}
                for it in session.items]
        Path(out).write_text(json.dumps(rows))


# The tripwire: while a test runs, a moecached daemon process or a compiler started by a test
# not marked for it fails that test, naming the marker it lacks.
_current: list = []
_DAEMON_MODULES = {"moecached.daemon", "moecached.tools.ctl"}
_DAEMON_SCRIPTS = {"moecached", "moecache-ctl"}
_BUILD_TOOLS = {"make", "cc", "gcc", "g++", "c++", "clang", "cmake"}


def _needs(args) -> str | None:
    if isinstance(args, (str, bytes, os.PathLike)):
        args = [args]
    try:
        argv = [os.fsdecode(a) for a in args]
    except TypeError:
        return None
    if not argv:
        return None
    if os.path.basename(argv[0]) in _DAEMON_SCRIPTS or _DAEMON_MODULES & set(argv):
        return "daemon"
    if os.path.basename(argv[0]) in _BUILD_TOOLS:
        return "build"
    return None


_popen_init = subprocess.Popen.__init__


def _checked_popen_init(self, args, *a, **kw):
    need = _needs(args)
    if need and _current and not _current[-1].get_closest_marker(need):
        self._child_created = False   # what Popen.__del__ looks at
        pytest.fail(f"{_current[-1].nodeid} starts {args!r} but is not marked {need!r}: mark it "
                    f"@pytest.mark.{need} (or name start_daemon/daemon_procs so tests/conftest.py "
                    "sorts it)", pytrace=False)
    _popen_init(self, args, *a, **kw)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.append(item)
    subprocess.Popen.__init__ = _checked_popen_init
    try:
        yield
    finally:
        _current.pop()
        if not _current:
            subprocess.Popen.__init__ = _popen_init
