#!/usr/bin/env bash
# The whole test suite, on a fresh machine with Rust, Python 3 + pip and a
# C++ compiler (the README's test command):
#   1. a project-local Python environment with numpy (.cache/py);
#   2. the CUDA compiler pieces (scripts/provision-cuda.sh, when present),
#      then KIVI_REQUIRE_NVRTC=1 so that tests needing NVRTC fail rather
#      than skip;
#   3. cargo test --workspace: unit, integration, fuzz (CI size),
#      compile-fail (trybuild), example builds and doc tests;
#   4. `kivi attend` against the independent numpy implementation of
#      DESIGN.md section 3 (tests/python/check_attend.py);
#   5. the main job, at a short context, as a smoke test;
#   6. `kivi generate` end to end on Gemma 3 270M (the `eval` feature).
# Idempotent, and quick when already set up. Every step runs even when an
# earlier one failed. The last line counts tests, not steps: every cargo
# "test result: ... N passed; M failed" line, the numpy checks and the smoke
# test, as `test.sh: N passed, M failed`; the exit status is non-zero if
# anything failed.
set -uo pipefail

cd "$(dirname "$0")/.."
root="$(pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
case "$target" in /*) ;; *) target="$root/$target" ;; esac

steps_ok=0
steps_failed=0
failures=()
# Tests, counted from each step's output (see count_*).
tests_passed=0
tests_failed=0
logs="$target/test-sh"
mkdir -p "$logs"

# `count KIND LOG`: "passed failed" of one step's output.
count() {
    case "$1" in
        # cargo: every "test result: ok. 12 passed; 0 failed; ..." line
        cargo) awk '/^test result: /{ for (i = 2; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) } } END { print p + 0, f + 0 }' "$2" ;;
        # check_attend.py: "check_attend: 40 passed, 0 failed"
        python) awk '/^check_attend: [0-9]+ passed, [0-9]+ failed/{ p = $2; f = $4 } END { print p + 0, f + 0 }' "$2" ;;
        *) echo "0 0" ;;
    esac
}

# `step NAME KIND COMMAND...`: runs COMMAND, its output shown and kept in a
# log; KIND says how to count its tests (cargo, python, one = the step is
# one test, setup = not a test). A failed step with no failing test counted
# (a build error, a crash) counts as one failure.
step() {
    local name="$1" kind="$2"
    shift 2
    echo
    echo "==> $name"
    local start=$SECONDS log="$logs/step-$((steps_ok + steps_failed + 1)).log" status
    "$@" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    local p f
    if [ "$kind" = one ]; then
        if [ "$status" -eq 0 ]; then p=1 f=0; else p=0 f=1; fi
    else
        read -r p f < <(count "$kind" "$log")
    fi
    if [ "$status" -ne 0 ] && [ "$f" -eq 0 ]; then
        f=1
    fi
    tests_passed=$((tests_passed + p))
    tests_failed=$((tests_failed + f))
    if [ "$status" -eq 0 ]; then
        steps_ok=$((steps_ok + 1))
        echo "==> $name: ok ($((SECONDS - start)) s)"
    else
        steps_failed=$((steps_failed + 1))
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
}

# The environment NVRTC's tests need, set in this shell (a step runs in a
# pipeline, so a subshell: its exports would not survive). Once NVRTC is
# provisioned, a test that needs it must fail, not skip, when it is missing.
nvrtc_env() {
    if [ -f "$root/.cache/nvidia/env.sh" ]; then
        # Let the CUDA tests find NVRTC, the headers and ptxas.
        # shellcheck disable=SC1091
        . "$root/.cache/nvidia/env.sh"
        export KIVI_REQUIRE_NVRTC=1
    fi
}

cargo_tests() {
    # --no-fail-fast: report every failing test binary, not just the first
    cargo test --workspace --no-fail-fast
}

# The numpy check and the smoke test run the `kivi` binary and the main_job
# example that the workspace step built. Building them with `-p kivi-cli` or
# `cargo run --example` would resolve a different feature set for shared
# dependencies (`syn`, `half`, `proc-macro2`: cargo unifies features over
# the selected packages only) and rebuild much of the dependency tree, about
# two minutes of CI. `--no-run` again is a no-op after the workspace step and
# makes sure that what runs is what that step built (and links them again).
workspace_builds() {
    cargo test --workspace --no-run --quiet
}

numpy_check() {
    [ -n "$PY" ] || { echo "no Python environment with numpy (see the first step)"; return 1; }
    workspace_builds || return 1
    "$PY" tests/python/check_attend.py --kivi "$target/debug/kivi"
}

main_job_smoke() {
    workspace_builds || return 1
    KIVI_MAIN_JOB_GENERATE=8 "$target/debug/examples/main_job" 600
}

# `kivi generate` needs the `eval` feature (it brings the model), which the
# workspace run leaves off: its end-to-end tests run here, last, so that the
# feature's rebuild of the kivi binary happens once. `--workspace` keeps the
# workspace step's feature set for every other crate (only kivi-cli is
# rebuilt); `--test all` with the two modules' filters runs just them (the
# other crates' `all` binaries match none of their tests).
generate_tests() {
    cargo test --workspace --features kivi-cli/eval --test all -- generate:: policy::
}

# The decision-cache tests that watch system calls need strace (part of the
# project's machine image): fail rather than skip when it cannot run.
if command -v strace >/dev/null 2>&1; then
    export KIVI_REQUIRE_STRACE=1
fi

step "python env (numpy in .cache/py)" setup python_env
# python_env's exports (PYTHONPATH) must reach the later steps: set them here too.
[ -x "$root/.cache/py/bin/python" ] && PY="$root/.cache/py/bin/python"
if [ -z "$PY" ] && [ -d "$root/.cache/py/site" ]; then
    export PYTHONPATH="$root/.cache/py/site${PYTHONPATH:+:$PYTHONPATH}"
    PY=python3
fi
if [ -f scripts/provision-cuda.sh ]; then
    step "provision CUDA (scripts/provision-cuda.sh)" setup provision_cuda
    nvrtc_env
fi
step "cargo test --workspace --no-fail-fast" cargo cargo_tests
step "kivi attend vs numpy (tests/python/check_attend.py)" python numpy_check
step "main job smoke test (600 tokens)" one main_job_smoke
step "kivi generate on Gemma 3 270M (kivi-cli --features eval)" cargo generate_tests

echo
if [ "$steps_failed" -gt 0 ]; then
    printf 'failed step: %s\n' "${failures[@]}"
fi
echo "test.sh: $steps_ok of $((steps_ok + steps_failed)) steps ok; tests counted from cargo's \"test result\" lines, check_attend.py and the smoke test"
echo "test.sh: $tests_passed passed, $tests_failed failed"
[ "$steps_failed" -eq 0 ] && [ "$tests_failed" -eq 0 ]
