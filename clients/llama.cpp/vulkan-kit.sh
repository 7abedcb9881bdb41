#!/usr/bin/env bash
# What a Vulkan build of the patched llama.cpp needs where no package manager is (the GPU
# machine), from Debian's archive, unpacked (no root, no apt):
#
#   clients/llama.cpp/vulkan-kit.sh DIR
#
# DIR/include  the Vulkan headers of Debian 13's libvulkan-dev (this llama.cpp needs 1.3.268 or
#              later: VK_EXT_layer_settings; Debian 12's are 1.3.239) and its SPIR-V headers
#              (ggml-vulkan finds them as the CMake package SPIRV-Headers: DIR/share/cmake)
# DIR/bin      glslc of Debian 12 (the shader compiler, DIR/libexec, behind a wrapper that finds its
#              libshaderc in DIR/lib; it lacks the cooperative-matrix and
#              integer-dot extensions, so ggml leaves those shaders out)
# DIR/lib      libshaderc (glslc's), and the Vulkan loader of Debian 12 (libvulkan.so.1 and the
#              libvulkan.so link the build links against; glibc 2.36, so it runs on newer systems)
# DIR/env.sh   sourced before the build: Vulkan_INCLUDE_DIR, Vulkan_LIBRARY and
#              Vulkan_GLSLC_EXECUTABLE for CMake (as a toolchain file), PATH, LD_LIBRARY_PATH
#
# The GPU's own driver (its ICD, e.g. nvidia_icd.json) comes from the machine; without one the
# loader finds no device. Idempotent: packages already unpacked are kept.
set -euo pipefail
DIR=${1:?usage: vulkan-kit.sh DIR}
mkdir -p "$DIR/dl" "$DIR/root"
DIR=$(cd "$DIR" && pwd)
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# name, pool path: pinned versions, so a kit is the same wherever it is made
PKGS=(
    "libvulkan-dev_1.4.309.0-1_amd64.deb pool/main/v/vulkan-loader"
    "libvulkan1_1.3.239.0-1_amd64.deb pool/main/v/vulkan-loader"
    "glslc_2023.2-1_amd64.deb pool/main/s/shaderc"
    "libshaderc1_2023.2-1_amd64.deb pool/main/s/shaderc"
    "spirv-headers_1.6.1+1.4.309.0-1_all.deb pool/main/s/spirv-headers"
)
for p in "${PKGS[@]}"; do
    set -- $p
    f=$DIR/dl/$1
    if [ ! -s "$f" ]; then
        curl -fsSL --retry 3 -o "$f.part" "$MIRROR/$2/$1" || { echo "vulkan-kit.sh: cannot download $MIRROR/$2/$1" >&2; exit 1; }
        mv "$f.part" "$f"
    fi
    dpkg-deb -x "$f" "$DIR/root"
done
R=$DIR/root
mkdir -p "$DIR/include" "$DIR/bin" "$DIR/lib"
cp -r "$R/usr/include/." "$DIR/include/"
# what ggml-vulkan does not include stays out (the kit travels with .dev/, 64 MiB in all):
# vulkan.hpp's optional headers, SPIR-V's grammars and other languages' bindings
( cd "$DIR/include" && rm -f vulkan/vulkan_static_assertions.hpp vulkan/vulkan_hash.hpp vulkan/vulkan_raii.hpp \
      vulkan/vulkan_video.hpp vulkan/vulkan_format_traits.hpp vulkan/vulkan_extension_inspection.hpp \
      vulkan/vulkan_shared.hpp spirv/unified1/*.py spirv/unified1/*.cs spirv/unified1/*.bf spirv/unified1/*.json \
      spirv/unified1/*.hpp11 spirv/unified1/*.lua spirv/unified1/*.jl spirv/unified1/*.d spirv/unified1/*.cppm )
# glslc behind a wrapper that finds its libshaderc in the kit whatever LD_LIBRARY_PATH the build has
mkdir -p "$DIR/libexec" && cp "$R/usr/bin/glslc" "$DIR/libexec/"
cat > "$DIR/bin/glslc" <<'EOF'
#!/bin/sh
d=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/libexec/glslc" "$@"
EOF
chmod +x "$DIR/bin/glslc"
mkdir -p "$DIR/share" && cp -r "$R/usr/share/cmake" "$DIR/share/"
cp -a "$R"/usr/lib/x86_64-linux-gnu/libshaderc*.so* "$DIR/lib/"
cp -a "$R"/usr/lib/x86_64-linux-gnu/libvulkan.so.1* "$DIR/lib/"
ln -sfn libvulkan.so.1 "$DIR/lib/libvulkan.so"
# both relative to where they lie, so the kit still works carried elsewhere (.dev/ to the GPU machine)
cat > "$DIR/vulkan.cmake" <<'EOF'
# CMake toolchain file (CMAKE_TOOLCHAIN_FILE): the kit's headers, loader and glslc
set(_kit "${CMAKE_CURRENT_LIST_DIR}")
set(Vulkan_INCLUDE_DIR "${_kit}/include" CACHE PATH "vulkan-kit.sh")
set(Vulkan_LIBRARY "${_kit}/lib/libvulkan.so" CACHE FILEPATH "vulkan-kit.sh")
set(Vulkan_GLSLC_EXECUTABLE "${_kit}/bin/glslc" CACHE FILEPATH "vulkan-kit.sh")
set(SPIRV-Headers_DIR "${_kit}/share/cmake/SPIRV-Headers" CACHE PATH "vulkan-kit.sh")
EOF
cat > "$DIR/env.sh" <<'EOF'
# . DIR/env.sh: the kit's glslc and loader first
_kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PATH="$_kit/bin:$PATH" LD_LIBRARY_PATH="$_kit/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
EOF
env -u LD_LIBRARY_PATH "$DIR/bin/glslc" --version >/dev/null \
    || { echo "vulkan-kit.sh: the unpacked glslc does not run here" >&2; exit 1; }
grep -q VK_EXT_layer_settings "$DIR/include/vulkan/vulkan_core.h" \
    || { echo "vulkan-kit.sh: the headers lack VK_EXT_layer_settings" >&2; exit 1; }
echo "vulkan-kit.sh: $DIR (headers $(sed -n 's/^#define VK_HEADER_VERSION \([0-9]*\).*/1.x.\1/p' "$DIR/include/vulkan/vulkan_core.h"), glslc, loader)"
