"""The C client library (clients/c): build it, run its C tests (unit, against a real daemon,
the replay example) plain, under ASan+UBSan and under TSan, install it and build against the
installed pkg-config file, compile its header as C++.

Skipped, with the reason, when there is no C compiler, no make, or no libzmq/msgpack-c headers
(Debian: libzmq3-dev, libmsgpack-dev).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CDIR = REPO / "clients" / "c"


def _missing() -> str | None:
    for tool in ("cc", "make", "pkg-config"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH"
    probe = subprocess.run(["cc", "-x", "c", "-fsyntax-only", "-"], input="#include <zmq.h>\n#include <msgpack.h>\n",
                           text=True, capture_output=True)
    if probe.returncode:
        return "libzmq/msgpack-c headers missing (install libzmq3-dev and libmsgpack-dev): " + \
            probe.stderr.strip().splitlines()[0]
    return None


MISSING = _missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"C client not buildable: {MISSING}")


def _env() -> dict:
    paths = [str(REPO), str(REPO / "clients")]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def _make(*args: str, timeout: float = 600) -> str:
    p = subprocess.run(["make", "-C", str(CDIR), f"PYTHON={sys.executable}", *args], env=_env(), text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    assert p.returncode == 0, f"make {' '.join(args)} failed:\n{p.stdout[-8000:]}"
    return p.stdout


@pytest.mark.slow
def test_c_client_tests():
    out = _make("test")
    assert "test_daemon: ok" in out and "test_concurrency: ok" in out and "0 wrong parts, 0 invalid leases" in out


@pytest.mark.slow
def test_c_client_asan_ubsan():
    out = _make("test-asan")
    assert "test_daemon: ok" in out and "test_fastpath: ok" in out


@pytest.mark.slow
def test_c_client_tsan():
    out = _make("test-tsan")
    assert "test_concurrency: ok" in out and "test_daemon: ok" in out


def test_c_client_install_and_cxx(tmp_path):
    _make("install", f"PREFIX={tmp_path}", "B=build")
    inc = tmp_path / "include"
    assert (inc / "moecache.h").is_file() and (tmp_path / "lib" / "libmoecache.so").exists()
    env = dict(os.environ, PKG_CONFIG_PATH=str(tmp_path / "lib" / "pkgconfig"))
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "moecache"], env=env, text=True,
                           capture_output=True, check=True).stdout.split()
    assert f"-I{inc}" in flags and "-lmoecache" in flags
    exe = tmp_path / "cxx_smoke"
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler: the header's C++ side is not checked")
    subprocess.run([cxx, "-std=c++11", "-Wall", "-Werror", str(CDIR / "tests" / "cxx_smoke.cpp"), "-o", str(exe),
                    f"-L{tmp_path / 'lib'}", f"-Wl,-rpath,{tmp_path / 'lib'}", *flags], check=True)
    r = subprocess.run([str(exe)], text=True, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
