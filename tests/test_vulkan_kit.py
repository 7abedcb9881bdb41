"""clients/llama.cpp/vulkan-kit.sh: what a Vulkan build of the patched llama.cpp needs, unpacked
from Debian's archive where no package manager is (the GPU machine).

The kit travels to that machine inside a 64 MiB carry, so it leaves out what ggml-vulkan does
not include; its glslc must run whatever ``LD_LIBRARY_PATH`` the build sets (the device kit's
setup.sh sets its own, which once hid glslc's libshaderc: every shader failed with exit 127).
The packages are downloaded once into ``~/.cache/moecached-vulkan-kit`` (Debian's archive is
reachable where the suite runs).
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "clients" / "llama.cpp" / "vulkan-kit.sh"
CACHE = Path.home() / ".cache" / "moecached-vulkan-kit"

pytestmark = [pytest.mark.build, pytest.mark.timeout(600)]   # downloads and compiles: not the fast tier


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    d = tmp_path_factory.mktemp("vulkan-kit")
    if (CACHE / "dl").is_dir():
        shutil.copytree(CACHE / "dl", d / "dl")
    r = subprocess.run(["bash", str(KIT), str(d)], capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stdout + r.stderr
    CACHE.mkdir(parents=True, exist_ok=True)
    shutil.copytree(d / "dl", CACHE / "dl", dirs_exist_ok=True)
    return d


def test_glslc_runs_whatever_the_library_path(kit, tmp_path):
    src = tmp_path / "add.comp"
    src.write_text("#version 450\nlayout(local_size_x = 64) in;\n"
                   "layout(binding = 0) buffer B { float x[]; };\n"
                   "void main() { x[gl_GlobalInvocationID.x] += 1.0; }\n")
    for ld in (None, "/nonexistent", str(tmp_path)):
        env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        if ld is not None:
            env["LD_LIBRARY_PATH"] = ld
        out = tmp_path / "add.spv"
        out.unlink(missing_ok=True)
        r = subprocess.run([str(kit / "bin" / "glslc"), "-fshader-stage=compute", str(src), "-o", str(out)],
                           capture_output=True, text=True, env=env)
        assert r.returncode == 0, (ld, r.stderr)
        assert out.read_bytes()[:4] == bytes.fromhex("03022307"), "not a SPIR-V module"


def test_the_headers_ggml_vulkan_includes_still_compile(kit, tmp_path):
    src = tmp_path / "uses.cpp"
    src.write_text("#include <vulkan/vulkan_core.h>\n#include <vulkan/vulkan.hpp>\n"
                   "#include <spirv/unified1/spirv.hpp>\n"
                   "int main() { vk::ApplicationInfo a; return a.apiVersion == 0 ? 0 : 1; }\n")
    r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-I", str(kit / "include"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (kit / "share" / "cmake" / "SPIRV-Headers").is_dir()   # find_package(SPIRV-Headers)


def test_the_kit_is_small_enough_to_travel(kit):
    left_out = ["include/vulkan/vulkan_raii.hpp", "include/vulkan/vulkan_static_assertions.hpp",
                "include/spirv/unified1/spirv.core.grammar.json"]
    for p in left_out:
        assert not (kit / p).exists(), p
    size = sum(f.stat().st_size for part in ("bin", "include", "lib", "libexec", "share")
               for f in (kit / part).rglob("*") if f.is_file() and not f.is_symlink())
    print(f"kit without its downloads: {size / 2**20:.1f} MiB")
    assert size < 32 * 2**20, size
