"""The C client library (clients/c): build it, run its C tests (unit, against a real daemon,
the replay example) plain, under ASan+UBSan and under TSan, install it and build against the
installed pkg-config file, compile its header as C++.

Skipped, with the reason, when there is no C compiler, no make, or no libzmq/msgpack-c headers
(Debian: libzmq3-dev, and libmsgpack-c-dev or before Debian 13 libmsgpack-dev).
"""
from __future__ import annotations

import os
import re
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
        return "libzmq/msgpack-c headers missing (install libzmq3-dev and libmsgpack-c-dev, or libmsgpack-dev " \
            "before Debian 13): " + \
            probe.stderr.strip().splitlines()[0]
    return None


MISSING = _missing()
pytestmark = [pytest.mark.skipif(MISSING is not None, reason=f"C client not buildable: {MISSING}"),
              pytest.mark.timeout(1800)]   # a make may take its 600 s, and a test runs more than one


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


def _public_api() -> set[str]:
    """The functions moecache.h exports (declared MC_API)."""
    text = (CDIR / "include" / "moecache.h").read_text()
    return set(re.findall(r"^MC_API [^(]*?\b(mc_\w+)\(", text, re.M))


def test_c_client_install_and_cxx(tmp_path):
    """make install PREFIX=...: the pkg-config file alone builds and runs a program (its Libs carry
    the rpath: no -Wl,-rpath here, no LD_LIBRARY_PATH); the library exports only the public API."""
    prefix = tmp_path / "prefix"
    _make("install", f"PREFIX={prefix}", f"B={tmp_path / 'build'}")
    inc, lib = prefix / "include", prefix / "lib"
    assert (inc / "moecache.h").is_file() and (lib / "libmoecache.so").exists()
    env = dict(os.environ, PKG_CONFIG_PATH=str(lib / "pkgconfig"))
    env.pop("LD_LIBRARY_PATH", None)
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "moecache"], env=env, text=True,
                           capture_output=True, check=True).stdout.split()
    assert f"-I{inc}" in flags and "-lmoecache" in flags and f"-Wl,-rpath,{lib}" in flags, flags
    # symbols: exactly the MC_API functions of moecache.h (internal helpers hidden)
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib / "libmoecache.so")], text=True,
                        capture_output=True, check=True).stdout
    exported = {ln.split()[-1] for ln in nm.splitlines() if ln.split() and ln.split()[-2] in "TtDdBbRrWiV"}
    api = _public_api()
    assert len(api) >= 30 and exported == api, (sorted(exported - api), sorted(api - exported))
    exe = tmp_path / "cxx_smoke"
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler: the header's C++ side is not checked")
    subprocess.run([cxx, "-std=c++11", "-Wall", "-Werror", str(CDIR / "tests" / "cxx_smoke.cpp"), "-o", str(exe),
                    *flags], check=True, env=env)
    r = subprocess.run([str(exe)], text=True, capture_output=True, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr


def test_installed_example_runs_without_ld_library_path(tmp_path, model_factory):
    """The installed example (bin/moecache-replay, linked to lib/libmoecache.so.0 by rpath) finds the
    library by itself and replays a trace against a daemon."""
    from daemon_util import Daemon
    prefix = tmp_path / "prefix"
    _make("install", f"PREFIX={prefix}", f"B={tmp_path / 'build'}")
    exe = prefix / "bin" / "moecache-replay"
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    ldd = subprocess.run(["ldd", str(exe)], text=True, capture_output=True, env=env).stdout
    assert f"libmoecache.so.0 => {prefix / 'lib' / 'libmoecache.so.0'}" in ldd, ldd
    model = model_factory("qwen3-30b-a3b-Q4_K_M", layers=2, experts=8)
    trace = tmp_path / "trace.txt"
    trace.write_text("".join(f"{t} {layer} {t % 8} {(t + 3) % 8}\n" for t in range(6) for layer in range(2)))
    with Daemon(model, tmp_path, slots=8) as d:
        r = subprocess.run([str(exe), d.endpoint, str(trace)], text=True, capture_output=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr


def _make_fails(tmp_path, **tools) -> str:
    p = subprocess.run(["make", "-C", str(CDIR), f"B={tmp_path / 'build'}", *(f"{k}={v}" for k, v in tools.items())],
                       text=True, capture_output=True, timeout=120)
    assert p.returncode != 0 and not (tmp_path / "build").exists(), p.stdout + p.stderr
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip() and not ln.startswith("make:")]
    assert len(lines) == 1, lines   # one line, before anything is compiled
    return lines[0]


def _tool(tmp_path, name: str, real: str, refuse: str) -> Path:
    """A wrapper of `real` that fails whenever its arguments mention `refuse` (a missing library)."""
    p = tmp_path / name
    p.write_text(f'#!/bin/sh\ncase "$*" in *{refuse}*) exit 1;; esac\nexec {real} "$@"\n')
    p.chmod(0o755)
    return p


def test_missing_dependencies_stop_make_with_the_package_to_install(tmp_path):
    line = _make_fails(tmp_path, PKG_CONFIG=_tool(tmp_path, "pc", "pkg-config", "zmq"),
                       CC=_tool(tmp_path, "cc", "cc", "zmq"))
    assert "libzmq not found" in line and "libzmq3-dev" in line, line
    line = _make_fails(tmp_path, PKG_CONFIG=_tool(tmp_path, "pc", "pkg-config", "msgpack"),
                       CC=_tool(tmp_path, "cc", "cc", "msgpack"))
    assert "msgpack-c not found" in line and "libmsgpack-c-dev" in line and "libmsgpack-dev" in line, line


def test_dependencies_without_pkg_config_files_and_msgpack_c_6(tmp_path):
    """No .pc files: plain -l flags that link, and moecache.pc names them in Libs.private; a
    msgpack-c.pc (msgpack-c 6's name) is preferred over msgpack.pc."""
    _make(f"B={tmp_path / 'plain'}", "PKG_CONFIG=false", f"PREFIX={tmp_path}", str(tmp_path / "plain" / "moecache.pc"),
          str(tmp_path / "plain" / "libmoecache.so"))
    pc = (tmp_path / "plain" / "moecache.pc").read_text()
    assert re.search(r"^Requires.private: *$", pc, re.M) and re.search(r"^Libs.private: -lzmq -lmsgpack-?c -lpthread$", pc, re.M), pc
    fake = tmp_path / "pc"
    fake.mkdir()
    msgpack_libs = subprocess.run(["pkg-config", "--libs", "msgpack"], text=True, capture_output=True).stdout.strip()
    if not msgpack_libs:
        pytest.skip("no msgpack.pc here to stand in for msgpack-c.pc")
    (fake / "msgpack-c.pc").write_text(f"Name: msgpack-c\nDescription: stand-in\nVersion: 6.0.0\nLibs: {msgpack_libs}\nCflags:\n")
    old = os.environ.get("PKG_CONFIG_PATH")
    os.environ["PKG_CONFIG_PATH"] = os.pathsep.join([str(fake)] + ([old] if old else []))
    try:
        _make(f"B={tmp_path / 'six'}", f"PREFIX={tmp_path}", str(tmp_path / "six" / "moecache.pc"))
    finally:
        if old is None:
            del os.environ["PKG_CONFIG_PATH"]
        else:
            os.environ["PKG_CONFIG_PATH"] = old
    assert re.search(r"^Requires.private: libzmq msgpack-c$", (tmp_path / "six" / "moecache.pc").read_text(), re.M)


CONNECT_C = r'''
#include "moecache.h"
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
    (void)argc;
    mc_error err;
    mc_client *c = mc_connect(argv[1], "populate-probe", NULL, &err);
    if (!c) { fprintf(stderr, "connect failed: %s\n", err.message); return 1; }
    long size = 0, rss = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f || fscanf(f, "%ld %ld", &size, &rss) != 2) return 2;
    fclose(f);
    printf("rss %ld\n", rss * sysconf(_SC_PAGESIZE));
    mc_close(c);
    return 0;
}
'''


def test_populate_fills_resident_slots_and_no_given_back_one(tmp_path, model_factory):
    """A client connecting with ``populate`` (the default) after the daemon's budget shrank fills
    the page tables of the experts the arena holds, and never reads a given-back slot: a read of a
    hole of the tmpfs arena would allocate a page there, which the daemon punches again (moving the
    releases word, which ends other engines' CUDA registrations)."""
    import signal
    import time

    from daemon_util import start_daemon, stop_daemon, wait_for
    from moecache_client import Client
    prefix = tmp_path / "prefix"
    _make("install", f"PREFIX={prefix}", f"B={tmp_path / 'build'}")
    env = dict(os.environ, PKG_CONFIG_PATH=str(prefix / "lib" / "pkgconfig"))
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "moecache"], env=env, text=True,
                           capture_output=True, check=True).stdout.split()
    (tmp_path / "probe.c").write_text(CONNECT_C)
    exe = tmp_path / "probe"
    subprocess.run(["cc", str(tmp_path / "probe.c"), "-o", str(exe), *flags], check=True, env=env)
    model = model_factory("qwen3-30b-a3b-Q4_K_M", layers=2, experts=16)
    conf = tmp_path / "d.toml"
    conf.write_text("slots = 32\n")
    sock = str(tmp_path / "d.sock")
    d = start_daemon(str(model), sock, "--config", str(conf), "--log-level", "info")
    try:
        with Client(f"ipc://{sock}", name="t", fast_path=False) as c:
            for layer in c.expert_layers:
                c.acquire(layer, list(range(16))).release()
            conf.write_text("slots = 8\n")
            d.send_signal(signal.SIGHUP)
            wait_for(lambda: sum(x["slots"] for x in c.stats()["classes"]) == 8, "the shrink", 10)
            path = c.arena.descriptor["path"]
            slot_bytes = max(k["slot_bytes"] for k in c.arena.descriptor["classes"])
            shrunk = os.stat(path).st_blocks

            def probe(populate: str) -> int:
                r = subprocess.run([str(exe), f"ipc://{sock}"], text=True, capture_output=True, timeout=60,
                                   env=dict(env, MOECACHE_POPULATE=populate))
                assert r.returncode == 0, r.stdout + r.stderr
                return int(r.stdout.split()[1])

            rss_off = probe("0")
            rss_on = probe("1")
            assert os.stat(path).st_blocks <= shrunk, "the connect read given-back slots (holes) into memory"
            assert rss_on - rss_off >= 0.9 * 8 * slot_bytes, (rss_on, rss_off, slot_bytes)
            time.sleep(2.5)   # the daemon's ticks: what it finds to punch again
            assert c.stats()["repunched_bytes"] == 0
    finally:
        out = stop_daemon(d)
    assert "punched again in the arena" not in out, out
