#!/usr/bin/env bash
# Build llama.cpp with the moecached patch series (experts served by the daemon).
#
#   clients/llama.cpp/build.sh [--cache DIR] [--backend cpu|vulkan|cuda] [--jobs N] [--tools]
#                              [--server] [--target NAME]...
#
# The llama.cpp tree is the one vendored by the llama-cpp-python sdist (pinned version and
# sha256 below). Everything goes under DIR (default $MOECACHED_LLAMA_CACHE, else
# $HOME/.cache/moecached-llama), never inside the clone:
#   DIR/dl/            the sdist (from PyPI's simple index; or put the file there yourself)
#   DIR/src/           the extracted tree with patch/*.patch applied in name order (redone when
#                      a patch changes; files the new series leaves as they were keep their mtimes)
#   DIR/build-BACKEND/ the CMake build, reused (incremental) on the next run
#   DIR/bin -> DIR/build-BACKEND/bin
# Targets: mc-decode (the checking/benchmark driver) and llama-quantize; --tools adds
# llama-completion, llama-perplexity, llama-tokenize, llama-cli and llama-server; --server adds
# llama-server alone (all of them take --moecached ENDPOINT); --target NAME adds one CMake
# target (e.g. --target llama-bench). The server is built without its web UI (the pinned tree
# would fetch it from Hugging Face or build it with npm; neither is done: no network needed),
# so it serves the HTTP API only.
# The last line printed is the bin directory.
set -euo pipefail

PIN_VERSION=0.3.36
PIN_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
SDIST=llama_cpp_python-${PIN_VERSION}.tar.gz

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CACHE=${MOECACHED_LLAMA_CACHE:-$HOME/.cache/moecached-llama}
BACKEND=cpu
JOBS=$(( $(nproc 2>/dev/null || echo 2) ))
TOOLS=0
SERVER=0
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --cache) CACHE=$2; shift 2 ;;
        --backend) BACKEND=$2; shift 2 ;;
        --jobs|-j) JOBS=$2; shift 2 ;;
        --tools) TOOLS=1; shift ;;
        --server) SERVER=1; shift ;;
        --target) EXTRA+=("$2"); shift 2 ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$BACKEND" in
    cpu) CMAKE_BACKEND=() ;;
    vulkan) CMAKE_BACKEND=(-DGGML_VULKAN=ON) ;;
    cuda) CMAKE_BACKEND=(-DGGML_CUDA=ON) ;;
    *) echo "build.sh: --backend $BACKEND: expected cpu, vulkan or cuda" >&2; exit 2 ;;
esac
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
case "$CACHE/" in
    "$ROOT"/*) echo "build.sh: --cache $CACHE is inside the clone ($ROOT); give a directory outside it" >&2; exit 2 ;;
esac
for tool in cmake make cc c++ tar sha256sum patch; do
    command -v "$tool" >/dev/null || { echo "build.sh: $tool not found; install it" >&2; exit 2; }
done

# 1. the pinned sdist
mkdir -p "$CACHE/dl"
if [ ! -f "$CACHE/dl/$SDIST" ]; then
    echo "build.sh: downloading llama-cpp-python==$PIN_VERSION (sdist, ~77 MB) into $CACHE/dl" >&2
    # The file itself, found in PyPI's simple index (PEP 691 JSON): `pip download` of an sdist
    # would first build its backend's dependencies from source (cmake among them).
    python3 - "$SDIST" "$CACHE/dl" <<'PY' >&2
import json, os, sys, urllib.request
name, dest = sys.argv[1], sys.argv[2]
index = os.environ.get("MOECACHED_PYPI_SIMPLE", "https://pypi.org/simple")
req = urllib.request.Request(f"{index}/llama-cpp-python/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
url = next(f["url"] for f in files if f["filename"] == name)
urllib.request.urlretrieve(url, os.path.join(dest, name + ".part"))
os.replace(os.path.join(dest, name + ".part"), os.path.join(dest, name))
PY
fi
got=$(sha256sum "$CACHE/dl/$SDIST" | cut -d' ' -f1)
if [ "$got" != "$PIN_SHA256" ]; then
    echo "build.sh: $CACHE/dl/$SDIST: sha256 $got, expected $PIN_SHA256; delete the file and run again" >&2
    exit 1
fi

# 2. the patched tree: re-extracted whenever a patch of the series or the driver changes (the
#    archive's mtimes are kept, so the next build only recompiles what the patches touch). The
#    series is patch/*.patch in name order (patch/README.md); the key covers their names too.
PATCHES=()
while IFS= read -r p; do PATCHES+=("$p"); done < <(LC_ALL=C ls "$HERE"/patch/*.patch 2>/dev/null)
[ ${#PATCHES[@]} -gt 0 ] || { echo "build.sh: no patch/*.patch in $HERE" >&2; exit 1; }
KEY=$( { for p in "${PATCHES[@]}"; do basename "$p"; cat "$p"; done
         cat "$HERE/driver/mc-decode.cpp" "$HERE/driver/CMakeLists.txt"; } | sha256sum | cut -c1-12)
SRC="$CACHE/src"
if [ "$(cat "$SRC/.moecached-patch" 2>/dev/null)" != "$KEY" ]; then
    rm -rf "$SRC.tmp"
    mkdir -p "$SRC.tmp"
    tar -xzf "$CACHE/dl/$SDIST" -C "$SRC.tmp" --strip-components=3 "llama_cpp_python-$PIN_VERSION/vendor/llama.cpp"
    rm -f "$SRC.tmp/.git"
    for p in "${PATCHES[@]}"; do
        (cd "$SRC.tmp" && patch -p1 --quiet --forward < "$p") \
            || { echo "build.sh: patch/$(basename "$p") does not apply to llama-cpp-python $PIN_VERSION (after the patches before it)" >&2; exit 1; }
    done
    mkdir -p "$SRC.tmp/examples/mc-decode"
    cp "$HERE/driver/mc-decode.cpp" "$HERE/driver/CMakeLists.txt" "$SRC.tmp/examples/mc-decode/"
    # a file whose content did not change keeps the previous tree's mtime (patch and cp give
    # the files they write a new one): the build then recompiles only what changed, not
    # everything that includes llama.h
    if [ -d "$SRC" ]; then
        { grep -h '^+++ b/' "${PATCHES[@]}" | cut -c7- | cut -f1 | sort -u;
          echo examples/mc-decode/mc-decode.cpp; echo examples/mc-decode/CMakeLists.txt; } |
        while read -r f; do
            if [ -f "$SRC/$f" ] && cmp -s "$SRC/$f" "$SRC.tmp/$f"; then touch -r "$SRC/$f" "$SRC.tmp/$f"; fi
        done
    fi
    echo "$KEY" > "$SRC.tmp/.moecached-patch"
    rm -rf "$SRC"
    mv "$SRC.tmp" "$SRC"
fi

# 3. libmoecache (a copy under the cache, so the build does not depend on the clone's path)
MC="$CACHE/moecache-c"
make -s -C "$ROOT/clients/c" B="$MC/build" "$MC/build/libmoecache.a" >&2
mkdir -p "$MC/include"
for h in moecache.h moecache_shm.h; do   # copied only when changed (a new mtime rebuilds the glue)
    cmp -s "$ROOT/clients/c/include/$h" "$MC/include/$h" || cp "$ROOT/clients/c/include/$h" "$MC/include/"
done

# 4. CMake build (reused)
BUILD="$CACHE/build-$BACKEND"
if [ -f "$BUILD/CMakeCache.txt" ] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$SRC" "$BUILD/CMakeCache.txt"; then
    rm -rf "$BUILD"   # configured for another source tree
fi
TARGETS=(mc-decode llama-quantize)
# (llama-cli of this tree is a front end of the server's library: it needs LLAMA_BUILD_SERVER)
[ "$TOOLS" = 1 ] && TARGETS+=(llama-completion llama-perplexity llama-tokenize llama-cli llama-server)
[ "$SERVER" = 1 ] && [ "$TOOLS" = 0 ] && TARGETS+=(llama-server)
TARGETS+=(${EXTRA[@]+"${EXTRA[@]}"})
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_MOECACHED_DIR="$MC" "${CMAKE_BACKEND[@]}" >"$CACHE/cmake-$BACKEND.log" 2>&1 \
    || { echo "build.sh: cmake configure failed; see $CACHE/cmake-$BACKEND.log" >&2; exit 1; }
cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" >"$CACHE/build-$BACKEND.log" 2>&1 \
    || { tail -20 "$CACHE/build-$BACKEND.log" >&2; echo "build.sh: build failed; see $CACHE/build-$BACKEND.log" >&2; exit 1; }
ln -sfn "$BUILD/bin" "$CACHE/bin"
echo "$BUILD/bin"
