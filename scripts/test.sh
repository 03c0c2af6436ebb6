#!/usr/bin/env bash
# The whole test suite, on a fresh machine with Rust, Python 3 + pip and a
# C++ compiler (the README's test command):
#   1. a project-local Python environment with numpy (.cache/py);
#   2. the CUDA compiler pieces (scripts/provision-cuda.sh, when present);
#   3. cargo test --workspace: unit, integration, compile-fail (trybuild),
#      example builds and doc tests;
#   4. `kivi attend` against the independent numpy implementation of
#      DESIGN.md section 3 (tests/python/check_attend.py);
#   5. the main job, at a short context, as a smoke test.
# Idempotent, and quick when already set up. Every step runs even when an
# earlier one failed; the last line is a summary and the exit status is
# non-zero if anything failed.
set -uo pipefail

cd "$(dirname "$0")/.."
root="$(pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
case "$target" in /*) ;; *) target="$root/$target" ;; esac

passed=0
failed=0
failures=()

step() {
    local name="$1"
    shift
    echo
    echo "==> $name"
    local start=$SECONDS
    if "$@"; then
        passed=$((passed + 1))
        echo "==> $name: ok ($((SECONDS - start)) s)"
    else
        failed=$((failed + 1))
        failures+=("$name")
        echo "==> $name: FAILED ($((SECONDS - start)) s)"
    fi
}

# numpy in .cache/py: a venv when the venv module works, else a pip --target
# folder put on PYTHONPATH (some distributions ship python3 without venv).
PY=""
python_env() {
    local venv="$root/.cache/py"
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import numpy' 2>/dev/null; then
        PY="$venv/bin/python"
        return 0
    fi
    if [ -d "$venv/site" ] && PYTHONPATH="$venv/site" python3 -c 'import numpy' 2>/dev/null; then
        export PYTHONPATH="$venv/site${PYTHONPATH:+:$PYTHONPATH}"
        PY=python3
        return 0
    fi
    mkdir -p "$root/.cache"
    if python3 -m venv "$venv" >/dev/null 2>&1 && [ -x "$venv/bin/python" ]; then
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check numpy || return 1
        PY="$venv/bin/python"
    else
        rm -rf "$venv"
        python3 -m pip install --quiet --disable-pip-version-check --target "$venv/site" numpy || return 1
        export PYTHONPATH="$venv/site${PYTHONPATH:+:$PYTHONPATH}"
        PY=python3
    fi
    "$PY" -c 'import numpy; print("numpy", numpy.__version__)'
}

provision_cuda() {
    bash scripts/provision-cuda.sh --quiet || return 1
    # Let the CUDA tests find NVRTC, the headers and ptxas.
    if [ -f "$root/.cache/nvidia/env.sh" ]; then
        # shellcheck disable=SC1091
        . "$root/.cache/nvidia/env.sh"
    fi
}

cargo_tests() {
    # --no-fail-fast: report every failing test binary, not just the first
    cargo test --workspace --no-fail-fast
}

numpy_check() {
    [ -n "$PY" ] || { echo "no Python environment with numpy (see the first step)"; return 1; }
    cargo build --quiet -p kivi-tuner --bin kivi || return 1
    "$PY" tests/python/check_attend.py --kivi "$target/debug/kivi"
}

main_job_smoke() {
    cargo run --quiet --example main_job -- 600
}

step "python env (numpy in .cache/py)" python_env
if [ -f scripts/provision-cuda.sh ]; then
    step "provision CUDA (scripts/provision-cuda.sh)" provision_cuda
fi
step "cargo test --workspace --no-fail-fast" cargo_tests
step "kivi attend vs numpy (tests/python/check_attend.py)" numpy_check
step "main job smoke test (600 tokens)" main_job_smoke

echo
if [ "$failed" -gt 0 ]; then
    printf 'failed step: %s\n' "${failures[@]}"
fi
echo "test.sh: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
