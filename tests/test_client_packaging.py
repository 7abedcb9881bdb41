"""The Python client is its own distribution (clients/python) and installs with or without Cython.

Each is proved in a fresh virtual environment without the system's site-packages (so the global
Cython cannot leak in), on a copy of clients/python (and the clients/c/include it builds from):

* without Cython: ``pip install --no-build-isolation`` where only setuptools is installed. The
  install succeeds, the build prints the one-line note, ``IMPLEMENTATION`` is ``python``, and a
  client talking to a real daemon works over the socket and logs the note once;
* with Cython: a plain (isolated) ``pip install``, which fetches Cython for the build, builds
  the fast path: ``IMPLEMENTATION`` is ``cython`` and the same client pins through shared memory.

Needs a package index (pip downloads setuptools, Cython, pyzmq, msgpack, numpy): skipped when
pip cannot reach one. The rest of the file checks the metadata: one distribution per package,
the versions written once, the licence, ``py.typed`` and the client's annotated public API.
"""
from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLIENT = REPO / "clients" / "python"
NOTE = "shared-memory fast path OFF"

# the venv's client against the test's daemon: acquire, check the bytes arrived, say what ran
CLIENT_RUN = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")
import moecache_client as m
from moecache_client import Client
for _ in range(2):   # the note comes once per process, not once per client
    with Client(sys.argv[1], name="packaging") as c:
        with c.acquire(c.expert_layers[0], [0, 1]) as lease:
            assert lease.parts(1) and all(v.size for v in lease.parts(1).values())
        fast = c.fast_path
print("RESULT", m.IMPLEMENTATION, fast, m.__version__)
"""


def _run(cmd, timeout=240, **kw):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)


def _copy_client(dst: Path) -> Path:
    """clients/python as a source tree of its own (build outputs left out), with the files above it
    that it names: ../c/include and the LICENSE its symlink points at."""
    skip = shutil.ignore_patterns("build", "*.egg-info", "*.so", "*.c", "__pycache__")
    shutil.copytree(CLIENT, dst / "clients" / "python", ignore=skip, symlinks=True)
    shutil.copytree(REPO / "clients" / "c" / "include", dst / "clients" / "c" / "include")
    shutil.copy(REPO / "LICENSE", dst / "LICENSE")
    return dst / "clients" / "python"


@pytest.mark.slow
def test_client_installs_without_cython_then_with_it(tmp_path, model_factory):
    from daemon_util import Daemon
    src = _copy_client(tmp_path / "src")
    venv = tmp_path / "venv"
    r = _run([sys.executable, "-m", "venv", venv])
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    env.pop("MOECACHE_CLIENT_PURE", None)
    r = _run([py, "-m", "pip", "install", "-q", "setuptools>=77"], env=env)
    if r.returncode:
        pytest.skip(f"pip cannot install setuptools (no package index?): {r.stderr.strip()[-300:]}")
    assert _run([py, "-c", "import Cython"], env=env).returncode != 0, "Cython leaked into the fresh venv"

    # 1. no Cython, no build isolation: installs, socket only, the build says so in one line
    r = _run([py, "-m", "pip", "install", "-v", "--no-build-isolation", src], env=env, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    notes = [ln for ln in (r.stdout + r.stderr).splitlines() if NOTE in ln]
    assert notes and "Cython is not installed" in notes[0] and "--no-build-isolation" in notes[0], notes

    model = model_factory("qwen3-30b-a3b-Q4_K_M", layers=2, experts=8)
    with Daemon(model, tmp_path, slots=8) as d:
        r = _run([py, "-c", CLIENT_RUN, d.endpoint], env=env, cwd=tmp_path, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "RESULT python False" in r.stdout, r.stdout
        logged = [ln for ln in r.stderr.splitlines() if NOTE in ln]
        assert len(logged) == 1 and logged[0].startswith("LOG moecache_client ") and "pip install" in logged[0], \
            r.stderr
        # silenced where the socket path is chosen
        r = _run([py, "-c", CLIENT_RUN, d.endpoint], env=dict(env, MOECACHE_CLIENT_PURE="1"), cwd=tmp_path)
        assert r.returncode == 0 and NOTE not in r.stderr, r.stderr

        # 2. a plain install (pip fetches Cython for the build): the fast path is built and used
        r = _run([py, "-m", "pip", "install", "--force-reinstall", "--no-deps", src], env=env, timeout=400)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        r = _run([py, "-c", CLIENT_RUN, d.endpoint], env=env, cwd=tmp_path, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "RESULT cython True" in r.stdout and NOTE not in r.stderr, r.stdout + r.stderr
    # the installed distribution: typed, licensed
    r = _run([py, "-c", "import importlib.metadata as im, moecache_client, pathlib; d = im.distribution('moecache-client');"
              "print(d.metadata['License-Expression'], d.version);"
              "print((pathlib.Path(moecache_client.__file__).parent / 'py.typed').is_file())"], env=env, cwd=tmp_path)
    assert r.stdout.split() == ["MIT", _client_version(), "True"], r.stdout + r.stderr


def _pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def _client_version() -> str:
    m = re.search(r'^__version__ = "([^"]+)"$', (CLIENT / "moecache_client" / "__init__.py").read_text(), re.M)
    return m.group(1)


def test_each_package_is_shipped_by_one_distribution():
    top, client = _pyproject(REPO / "pyproject.toml"), _pyproject(CLIENT / "pyproject.toml")
    top_pkgs, client_pkgs = set(top["tool"]["setuptools"]["packages"]), set(client["tool"]["setuptools"]["packages"])
    assert not top_pkgs & client_pkgs, top_pkgs & client_pkgs
    assert "moecache_client" in client_pkgs and not any(p.startswith("moecache_client") for p in top_pkgs)
    assert "package-dir" not in top["tool"]["setuptools"]
    # extensions too: the top-level setup.py builds none of the client's
    assert "moecache_client" not in re.sub(r'""".*?"""', "", (REPO / "setup.py").read_text(), flags=re.S)
    # the daemon's tools use the client: the top-level distribution depends on it
    assert "moecache-client" in [re.split(r"[<>=!~ ;\[]", d)[0] for d in top["project"]["dependencies"]]


def test_versions_and_licence_are_written_once():
    import moecached
    top, client = _pyproject(REPO / "pyproject.toml"), _pyproject(CLIENT / "pyproject.toml")
    for proj, attr in ((top, "moecached.__version__"), (client, "moecache_client.__version__")):
        assert "version" not in proj["project"] and "version" in proj["project"]["dynamic"]
        assert proj["tool"]["setuptools"]["dynamic"]["version"] == {"attr": attr}
        assert proj["project"]["license"] == "MIT" and proj["project"]["license-files"] == ["LICENSE"]
    assert re.match(r"^\d+\.\d+\.\d+$", moecached.__version__) and re.match(r"^\d+\.\d+\.\d+$", _client_version())
    assert (REPO / "LICENSE").read_text().startswith("MIT License")
    assert (CLIENT / "LICENSE").resolve() == (REPO / "LICENSE").resolve()   # a link, not a copy


def test_client_is_typed_and_its_public_api_annotated():
    import moecache_client as m
    assert (CLIENT / "moecache_client" / "py.typed").is_file()
    assert "py.typed" in _pyproject(CLIENT / "pyproject.toml")["tool"]["setuptools"]["package-data"]["moecache_client"]
    missing = []
    for name in m.__all__:
        cls = getattr(m, name)
        if not inspect.isclass(cls) or issubclass(cls, BaseException):
            continue
        for attr, v in vars(cls).items():
            f = v.fget if isinstance(v, property) else v
            public = not attr.startswith("_") or attr in ("__enter__", "__exit__") or \
                (attr == "__init__" and cls is not m.Lease)   # a Lease is made by the client
            if not public or not inspect.isfunction(f):
                continue
            sig = inspect.signature(f)
            missing += [f"{name}.{attr}({p})" for p, prm in sig.parameters.items()
                        if p != "self" and prm.annotation is inspect.Parameter.empty]
            if attr != "__init__" and sig.return_annotation is inspect.Signature.empty:
                missing.append(f"{name}.{attr} -> ?")
    assert not missing, missing
    import typing
    for name in ("acquire", "acquire_many", "acquire_async", "prefetch"):
        typing.get_type_hints(getattr(m.Client, name))   # the annotations resolve
