#!/usr/bin/env bash
# Builds ggml's CPU backend (ggml-base + ggml-cpu, the llama.cpp CPU
# backend) and kivi's shim (benches/ggml_shim.c) into one shared library,
# OUT/libkivi_ggml.so, for the `llama.cpp` peer of `kivi bench`.
#
#   scripts/build-ggml.sh [OUT [SHIM]]
#     OUT   default .cache/ggml/$KIVI_GGML_VERSION
#     SHIM  default benches/ggml_shim.c next to this script
#   KIVI_GGML_VERSION  the llama-cpp-python sdist to take ggml from (default 0.3.36)
#   PYTHON             the interpreter whose pip downloads it (default python3)
#
# Sources: the llama-cpp-python sdist on PyPI, which vendors llama.cpp and
# ggml (pip download, no wheel is built). Build: CMake (from PATH, else
# `pip install --target OUT/tools cmake`), Release (-O3), GGML_NATIVE
# (-march=native), ggml's own thread pool (no OpenMP), static libraries
# linked into the shim with -fPIC. A finished build leaves OUT/stamp; with
# a matching stamp the script exits at once (kivi checks the same stamp).
# `kivi bench --peers llama.cpp` runs this script (a copy compiled into the
# binary) on first use; run it by hand to build ahead of time.
set -euo pipefail

VERSION=${KIVI_GGML_VERSION:-0.3.36}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-.cache/ggml/$VERSION}
SHIM=${2:-$HERE/../benches/ggml_shim.c}
PY=${PYTHON:-python3}
JOBS=${KIVI_GGML_JOBS:-2}

die() {
    echo "build-ggml: $*" >&2
    exit 1
}

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
[ -f "$SHIM" ] || die "no shim source at $SHIM"
STAMP="llama-cpp-python $VERSION shim $(sha256sum "$SHIM" | cut -c1-16)"
if [ -f "$OUT/libkivi_ggml.so" ] && [ "$(cat "$OUT/stamp" 2>/dev/null)" = "$STAMP" ]; then
    echo "$OUT/libkivi_ggml.so"
    exit 0
fi

command -v cc >/dev/null || die "no C compiler (cc) on PATH; install gcc or clang"
command -v c++ >/dev/null || die "no C++ compiler (c++) on PATH; install g++ or clang++"
command -v make >/dev/null || die "no make on PATH; install make"
"$PY" -m pip --version >/dev/null 2>&1 || die "no pip for $PY; the ggml sources come from PyPI (llama-cpp-python $VERSION sdist)"

SRC=$OUT/src/llama_cpp_python-$VERSION
if [ ! -f "$SRC/vendor/llama.cpp/ggml/CMakeLists.txt" ]; then
    mkdir -p "$OUT/src"
    TGZ=$OUT/src/llama_cpp_python-$VERSION.tar.gz
    if [ ! -f "$TGZ" ]; then
        echo "build-ggml: pip download llama-cpp-python==$VERSION (sdist, about 77 MB)" >&2
        # --no-binary for this package only: its build requirements may come
        # as wheels (building cmake itself from source would take an hour).
        "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$OUT/src" >&2 ||
            die "pip download llama-cpp-python==$VERSION failed (no network to PyPI?); put the sdist at $TGZ by hand"
    fi
    tar xzf "$TGZ" -C "$OUT/src" "llama_cpp_python-$VERSION/vendor/llama.cpp/ggml" ||
        die "cannot unpack $TGZ"
fi
GGML=$SRC/vendor/llama.cpp/ggml
# The sdist leaves out ggml's pkg-config template, which configure insists
# on; an empty one is enough (nothing here is installed).
[ -f "$GGML/ggml.pc.in" ] || : >"$GGML/ggml.pc.in"

CMAKE=$(command -v cmake || true)
if [ -z "$CMAKE" ]; then
    CMAKE=$OUT/tools/cmake/data/bin/cmake
    if [ ! -x "$CMAKE" ]; then
        echo "build-ggml: no cmake on PATH; pip install --target $OUT/tools cmake" >&2
        "$PY" -m pip install -q --target "$OUT/tools" cmake >&2 ||
            die "no cmake on PATH and pip install cmake failed; install cmake"
    fi
    [ -x "$CMAKE" ] || die "pip installed cmake but $CMAKE is missing"
fi

echo "build-ggml: building ggml-base + ggml-cpu ($($CMAKE --version | head -1), -O3 -march=native, $JOBS jobs)" >&2
"$CMAKE" -S "$GGML" -B "$OUT/build" -G "Unix Makefiles" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
    -DGGML_NATIVE=ON \
    -DGGML_OPENMP=OFF \
    -DGGML_BLAS=OFF \
    -DGGML_CCACHE=OFF \
    -DGGML_BUILD_TESTS=OFF \
    -DGGML_BUILD_EXAMPLES=OFF >"$OUT/cmake-configure.log" 2>&1 ||
    die "cmake configure failed; see $OUT/cmake-configure.log"
"$CMAKE" --build "$OUT/build" --target ggml-cpu ggml-base -j "$JOBS" >"$OUT/cmake-build.log" 2>&1 ||
    die "cmake build failed; see $OUT/cmake-build.log"

BASE=$(find "$OUT/build" -name 'libggml-base.a' | head -1)
CPU=$(find "$OUT/build" -name 'libggml-cpu.a' | head -1)
[ -n "$BASE" ] && [ -n "$CPU" ] || die "the build made no libggml-base.a / libggml-cpu.a; see $OUT/cmake-build.log"
# c++ as the driver: ggml-cpu has C++ parts that need libstdc++.
c++ -shared -fPIC -O3 -march=native -x c "$SHIM" -x none -I "$GGML/include" \
    "$CPU" "$BASE" -lm -lpthread -o "$OUT/libkivi_ggml.so.tmp" ||
    die "cannot link the shim $SHIM against ggml"
mv "$OUT/libkivi_ggml.so.tmp" "$OUT/libkivi_ggml.so"
# The shim the library was built from, for kivi's tests to spot a stale build.
[ "$SHIM" -ef "$OUT/ggml_shim.c" ] || cp "$SHIM" "$OUT/ggml_shim.c"
echo "$STAMP" >"$OUT/stamp"
echo "$OUT/libkivi_ggml.so"
