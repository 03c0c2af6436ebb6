#!/usr/bin/env bash
# Builds everything scripts/gpu-check.sh runs on the GPU machine, which has a
# driver but no Rust toolchain, no network and no NVRTC:
#
#   target/gpu-bundle/
#     bin/device_decode, bin/device_extend, bin/device_codecs,
#     bin/device_block                   GPU test binaries (release, stripped)
#     bin/gpu_decode                     the GPU decode benchmark
#     artifacts.tar.xz                   CUBIN for ARCH of every kernel they
#                                        load (compiled here by NVRTC)
#     nvrtc-version                      the NVRTC that compiled them (the
#                                        cache key's toolchain half)
#     gpu-check.sh, manifest.txt
#
# Carry the one folder `target/gpu-bundle` (it stays well under 64 MiB) and
# run `bash target/gpu-bundle/gpu-check.sh OUT_DIR` there.
#
# Usage: scripts/gpu-bundle.sh [ARCH]      (default sm_90, the H200)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
arch="${1:-sm_90}"
bundle="$root/target/gpu-bundle"
cd "$root"

scripts/provision-cuda.sh --quiet >/dev/null
# shellcheck disable=SC1091
source .cache/nvidia/env.sh

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/cache"

# Build, and take the executables' paths from cargo's own report.
executables() {
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])
'
}
echo "gpu-bundle: building test and bench binaries (release)" >&2
{
    cargo test --release -p kivi-runtime --no-run --message-format=json \
        --test device_decode --test device_extend --test device_codecs --test device_block
    cargo bench -p kivi --no-run --message-format=json --bench gpu_decode
} | executables >"$bundle/executables.txt"

while read -r name path; do
    cp "$path" "$bundle/bin/$name"
    strip --strip-debug "$bundle/bin/$name" 2>/dev/null || true
done <"$bundle/executables.txt"
rm "$bundle/executables.txt"
for need in device_decode device_extend device_codecs device_block gpu_decode; do
    [ -x "$bundle/bin/$need" ] || { echo "gpu-bundle: $need was not built" >&2; exit 1; }
done

# Compile every kernel the binaries load, for ARCH, into the bundle's cache.
# Seed it with what the user cache already holds for ARCH (same keys: the
# key does not depend on paths).
user_cache="${KIVI_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kivi}"
mkdir -p "$bundle/cache/artifacts"
if [ -d "$user_cache/artifacts" ]; then
    find "$user_cache/artifacts" -maxdepth 1 -name "*-$arch-*.kart" -exec cp {} "$bundle/cache/artifacts/" \;
fi
echo "gpu-bundle: compiling kernels for $arch (seeded with $(ls "$bundle/cache/artifacts" | wc -l) cached)" >&2
export KIVI_CACHE_DIR="$bundle/cache"
export KIVI_CUDA_PRECOMPILE="$arch"
precompile_all() {
    for t in device_decode device_extend device_codecs device_block; do
        "$bundle/bin/$t" --test-threads=1 --nocapture >"$bundle/precompile-$t.log" 2>&1 \
            || { cat "$bundle/precompile-$t.log" >&2; echo "gpu-bundle: $t failed" >&2; exit 1; }
        grep -E 'PRECOMPILED' "$bundle/precompile-$t.log" >&2 || true
        rm "$bundle/precompile-$t.log"
    done
    "$bundle/bin/gpu_decode" --precompile "$arch" >&2
}
precompile_all

# The NVRTC version the artifacts were keyed with (offline mode needs it).
version="$(python3 - "$KIVI_CUDA_HOME" <<'EOF'
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1] + "/lib/libnvrtc.so.13")
a, b = ctypes.c_int(), ctypes.c_int()
lib.nvrtcVersion(ctypes.byref(a), ctypes.byref(b))
print(f"{a.value}.{b.value}")
EOF
)"
echo "$version" >"$bundle/nvrtc-version"

# Verify as the GPU machine will run: no NVRTC anywhere (offline mode), only
# the bundle's cache. A missing kernel fails here, not there.
echo "gpu-bundle: verifying the bundle offline (no NVRTC)" >&2
(
    export KIVI_CUDA_HOME=/nonexistent KIVI_NVRTC_VERSION="$version"
    unset LD_LIBRARY_PATH KIVI_PTXAS
    cd /tmp && precompile_all
)
unset KIVI_CUDA_PRECOMPILE

n="$(ls "$bundle/cache/artifacts" | wc -l)"
tar -C "$bundle/cache" -cf - artifacts | xz -T0 -3 >"$bundle/artifacts.tar.xz"
rm -rf "$bundle/cache"
cp scripts/gpu-check.sh "$bundle/gpu-check.sh"
{
    echo "kivi GPU bundle for $arch, built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "NVRTC $version; $n artifacts"
    (cd "$bundle" && ls -l bin artifacts.tar.xz)
} >"$bundle/manifest.txt"
size="$(du -sm "$bundle" | cut -f1)"
echo "gpu-bundle: $bundle ($size MiB, $n kernels for $arch, NVRTC $version)" >&2
if [ "$size" -ge 64 ]; then
    echo "gpu-bundle: warning: the bundle is $size MiB, over the 64 MiB a run may carry" >&2
fi
