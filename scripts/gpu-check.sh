#!/usr/bin/env bash
# Runs the CUDA tests and the GPU decode benchmark on a GPU machine, from a
# bundle built elsewhere by scripts/gpu-bundle.sh (that machine has no Rust
# toolchain, no network and no NVRTC), and writes the results to OUT_DIR:
#
#   OUT_DIR/gpu-check.json     summary: device, per-binary exit codes, verdict
#   OUT_DIR/<test>.log         each test binary's output
#   OUT_DIR/gpu_decode.json    benchmark results (ms, GB/s, fraction of peak)
#
# Usage: bash target/gpu-bundle/gpu-check.sh OUT_DIR [--quick]
#        (or scripts/gpu-check.sh OUT_DIR, which finds target/gpu-bundle)
# Exit: 0 all passed, 1 a test or the benchmark failed, 2 no GPU / no bundle.
set -uo pipefail

out="${1:-}"
quick="${2:-}"
if [ -z "$out" ]; then
    echo "usage: gpu-check.sh OUT_DIR [--quick]" >&2
    exit 2
fi
mkdir -p "$out"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -d "$here/bin" ]; then
    bundle="$here"
else
    bundle="$here/../target/gpu-bundle"
fi

fail_early() {
    echo "gpu-check: $1" >&2
    printf '{"ok": false, "reason": "%s"}\n' "$(echo "$1" | sed 's/"/\\"/g')" >"$out/gpu-check.json"
    exit 2
}

# 1. A GPU and its driver, before anything else.
if ! command -v nvidia-smi >/dev/null 2>&1; then
    fail_early "no GPU: nvidia-smi is not on this machine (run this on the GPU machine)"
fi
if ! gpu="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)" || [ -z "$gpu" ]; then
    fail_early "no GPU: nvidia-smi failed: $gpu"
fi
echo "gpu-check: $gpu" >&2

# 2. The bundle.
for need in bin/device_decode bin/device_extend bin/device_codecs bin/device_block bin/gpu_decode artifacts.tar.xz nvrtc-version; do
    [ -e "$bundle/$need" ] || fail_early "the bundle at $bundle lacks $need: run scripts/gpu-bundle.sh on the build machine and carry target/gpu-bundle"
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tar -C "$work" -xJf "$bundle/artifacts.tar.xz" || fail_early "cannot unpack $bundle/artifacts.tar.xz"
export KIVI_CACHE_DIR="$work"
export KIVI_NVRTC_VERSION="$(cat "$bundle/nvrtc-version")"
export KIVI_REQUIRE_GPU=1
# A carried NVRTC (.cache/nvidia) is used when present; otherwise offline mode.
if [ -d "$here/../.cache/nvidia/nvidia/cu13/lib" ]; then
    export KIVI_CUDA_HOME="$(cd "$here/../.cache/nvidia/nvidia/cu13" && pwd)"
fi

# 3. Tests, then the benchmark.
declare -A rc
for t in device_extend device_decode device_codecs device_block; do
    echo "gpu-check: running $t" >&2
    "$bundle/bin/$t" --test-threads=1 --nocapture >"$out/$t.log" 2>&1
    rc[$t]=$?
    grep -E '^test |test result|cuda:|panicked' "$out/$t.log" | tail -n 20 >&2
done
echo "gpu-check: running gpu_decode" >&2
bench_args=(--out "$out/gpu_decode.json")
[ "$quick" = "--quick" ] && bench_args+=(--quick)
"$bundle/bin/gpu_decode" "${bench_args[@]}" 2>&1 | tee "$out/gpu_decode.log" >&2
rc[gpu_decode]=${PIPESTATUS[0]}

ok=true
for k in "${!rc[@]}"; do
    [ "${rc[$k]}" -eq 0 ] || ok=false
done
{
    printf '{\n  "ok": %s,\n  "gpu": "%s",\n  "nvrtc": "%s",\n  "exit_codes": {' "$ok" "$gpu" "$KIVI_NVRTC_VERSION"
    sep=""
    for k in device_extend device_decode device_codecs device_block gpu_decode; do
        printf '%s"%s": %s' "$sep" "$k" "${rc[$k]}"
        sep=", "
    done
    printf '}\n}\n'
} >"$out/gpu-check.json"
cat "$out/gpu-check.json" >&2
$ok && exit 0 || exit 1
