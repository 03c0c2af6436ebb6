#!/usr/bin/env bash
# Provisions the CUDA 13.0 compiler pieces kivi needs, without a system
# toolkit and without a GPU: NVRTC (libnvrtc.so.13), the runtime headers
# (cuda_fp16.h, cuda_bf16.h, ...) and ptxas, from NVIDIA's PyPI wheels,
# installed into the project-local folder .cache/nvidia (ignored by git).
#
# Idempotent: when the three pieces are already there it installs nothing.
# NVRTC is pinned to 13.0.x because the GPU machine's driver (580, CUDA 13.0)
# cannot JIT PTX newer than ISA 9.0 (DESIGN.md §7).
#
# Prints the locations and writes .cache/nvidia/env.sh, which exports
#   KIVI_CUDA_HOME   the folder holding lib/, include/ and bin/ (kivi finds
#                    libnvrtc and the headers through it)
#   KIVI_PTXAS       the ptxas binary (the resource report runs it)
#   LD_LIBRARY_PATH  prefixed with $KIVI_CUDA_HOME/lib (belt and braces:
#                    kivi also loads libnvrtc by full path)
# Usage: scripts/provision-cuda.sh [--quiet]    then: source .cache/nvidia/env.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="$root/.cache/nvidia"
quiet="${1:-}"

say() { [ "$quiet" = "--quiet" ] || echo "provision-cuda: $*" >&2; }

find_home() {
    # The wheels unpack to nvidia/cu13/{lib,include,bin}; older layouts used
    # nvidia/cuda_nvrtc/... per package, so search rather than assume.
    local lib
    lib="$(find "$target" -name 'libnvrtc.so.13*' -not -name '*builtins*' 2>/dev/null | sort | head -n1)"
    [ -n "$lib" ] || return 1
    dirname "$(dirname "$lib")"
}

complete() {
    local home
    home="$(find_home)" || return 1
    [ -f "$home/include/cuda_fp16.h" ] && [ -f "$home/include/cuda_bf16.h" ] && [ -x "$home/bin/ptxas" ]
}

if complete; then
    say "already provisioned in $target"
else
    say "installing nvidia-cuda-{nvrtc,runtime,nvcc}==13.0.* into $target"
    mkdir -p "$target"
    pip_log="$target/pip.log"
    if ! python3 -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
        --target "$target" \
        'nvidia-cuda-nvrtc==13.0.*' 'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-nvcc==13.0.*' \
        >"$pip_log" 2>&1; then
        cat "$pip_log" >&2
        echo "provision-cuda: pip install failed (see above)" >&2
        exit 1
    fi
    if ! complete; then
        echo "provision-cuda: the wheels installed but libnvrtc.so.13, cuda_fp16.h, cuda_bf16.h or bin/ptxas is missing under $target" >&2
        exit 1
    fi
fi

home="$(find_home)"
lib="$(find "$home/lib" -maxdepth 1 -name 'libnvrtc.so.13*' -not -name '*builtins*' | sort | head -n1)"
cat >"$target/env.sh" <<EOF
# Written by scripts/provision-cuda.sh; source it before cargo test.
export KIVI_CUDA_HOME="$home"
export KIVI_PTXAS="$home/bin/ptxas"
case ":\${LD_LIBRARY_PATH:-}:" in
  *":$home/lib:"*) ;;
  *) export LD_LIBRARY_PATH="$home/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" ;;
esac
EOF
say "NVRTC:   $lib"
say "headers: $home/include"
say "ptxas:   $home/bin/ptxas ($("$home/bin/ptxas" --version | tail -n1))"
say "env:     source $target/env.sh"
# Machine-readable lines for scripts that prefer eval over source.
echo "KIVI_CUDA_HOME=$home"
echo "KIVI_PTXAS=$home/bin/ptxas"
