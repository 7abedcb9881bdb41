"""``mc-decode --help`` (the llama.cpp checking driver, clients/llama.cpp/driver) prints its usage.

Without llama.cpp: the driver's USAGE text is compiled alone and must name every option the
driver parses. With the patched build (MOECACHED_LLAMA_BIN or build.sh's cache): ``--help`` and
``-h`` print it on stdout and exit 0; a wrong argument prints it on stderr and exits 2.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from moecached.tools import engine_llama

DRIVER = Path(__file__).resolve().parents[1] / "clients" / "llama.cpp" / "driver" / "mc-decode.cpp"


def _parsed_options(src: str) -> set[str]:
    return set(re.findall(r'\ba == "(-[^"]+)"', src))


def test_usage_names_every_option(tmp_path):
    src = DRIVER.read_text()
    m = re.search(r"^static const char \* USAGE =\n(?:    \".*\"\n)*    \".*\";\n", src, re.M)
    assert m, "mc-decode.cpp: no USAGE string"
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    prog = tmp_path / "usage.cpp"
    prog.write_text("#include <cstdio>\n" + m.group(0) + "int main() { fputs(USAGE, stdout); return 0; }\n")
    subprocess.run([cxx, "-Wall", "-Werror", str(prog), "-o", str(tmp_path / "usage")], check=True)
    usage = subprocess.run([str(tmp_path / "usage")], capture_output=True, text=True, check=True).stdout
    assert usage.startswith("usage: mc-decode -m MODEL")
    listed = set(re.findall(r"^  (-[-\w]+)(?:, (--[-\w]+))?", usage, re.M))
    listed = {o for pair in listed for o in pair if o}
    parsed = _parsed_options(src)
    assert {"-h", "--help", "-m", "--moecached"} <= parsed
    assert parsed == listed, (sorted(parsed - listed), sorted(listed - parsed))


def test_built_driver_prints_usage():
    bin_dir = engine_llama.llama_bin()
    if bin_dir is None:
        pytest.skip("patched llama.cpp not built: run clients/llama.cpp/build.sh (or set MOECACHED_LLAMA_BIN)")
    exe = str(bin_dir / "mc-decode")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    if "unknown argument --help" in r.stderr:
        pytest.skip(f"{exe} was built from an older driver: run clients/llama.cpp/build.sh again")
    assert r.returncode == 0 and r.stdout.startswith("usage: mc-decode -m MODEL"), r.stdout + r.stderr
    assert "--moecached ENDPOINT" in r.stdout and r.stderr == ""
    assert subprocess.run([exe, "-h"], capture_output=True, text=True, timeout=60).stdout == r.stdout
    bad = subprocess.run([exe, "--no-such-option"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown argument --no-such-option" in bad.stderr and "usage: mc-decode" in bad.stderr
    none = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert none.returncode == 2 and "-m MODEL is required" in none.stderr
