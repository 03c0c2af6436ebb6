#!/usr/bin/env bash
# The fuzz targets at a larger size than CI runs them (cargo test runs
# 10,000 cases each). Usage:
#   scripts/fuzz.sh [CASES] [SEED]
# CASES defaults to 200000 per target, SEED to a new one per run (printed,
# so that a failure can be replayed: a failing case prints its own seed,
# and `KIVI_FUZZ_SEED=<seed> KIVI_FUZZ_CASES=1 cargo test ...` reruns it).
# Prints each target's count, panics, failures and time; exits non-zero if
# any target failed.
set -uo pipefail
cd "$(dirname "$0")/.."

cases="${1:-200000}"
seed="${2:-$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')}"
export KIVI_FUZZ_CASES="$cases" KIVI_FUZZ_SEED="$seed"
echo "fuzz.sh: $cases cases per target, seed $seed"

failed=0
# `run WHAT FILTER CARGO-ARGS...`: FILTER picks the target's module out of
# a crate's one test binary (tests/all), or is empty.
run() {
    local what="$1" filter="$2"
    shift 2
    echo
    echo "==> $what"
    local start=$SECONDS
    # The targets print their counts themselves (to stderr, past the
    # harness's capture); --nocapture shows the panic messages too.
    cargo test "$@" -- --nocapture $filter 2>&1 | grep -E '^fuzz |panicked|panic at|failure at|test result'
    if [ "${PIPESTATUS[0]}" -ne 0 ]; then
        failed=$((failed + 1))
        echo "==> $what: FAILED ($((SECONDS - start)) s)"
    else
        echo "==> $what: ok ($((SECONDS - start)) s)"
    fi
}

run "scheme text" "" -p kivi --test fuzz_scheme_text
run "cache operations" "" -p kivi-runtime --test fuzz_cache_ops
run "npy files" fuzz_npy:: -p kivi-cli --test all
run "decision files" fuzz_decisions:: -p kivi-tuner --test all

echo
echo "fuzz.sh: $((4 - failed)) passed, $failed failed"
[ "$failed" -eq 0 ]
