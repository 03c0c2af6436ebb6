#!/usr/bin/env bash
# The full simulator sweep, run before resolving work on the kernels or the
# device layer (CI runs each of these once, under the default schedule):
# every generated-kernel test of kivi-runtime — every decode variant of every
# preset on the main layouts, every prefill/append variant, the corner-case
# schemes, odd shapes, the codec pipeline (and every decode variant of
# codec2 and codec15, KIVI_FULL_SWEEP=1), low-rank caches (every decode variant
# of one case, KIVI_FULL_SWEEP=1), every decode variant of every vq case
# (sim_vq), every decode variant of the minmax-table / pre-RoPE key-outlier
# cases (sim_minmax), the barrier-deletion proof — under each of the
# simulator's strict thread schedules (in order, reverse, two seeded
# permutations), so a race that one order hides shows up in another.
# Then, once (NVRTC does not depend on the schedule), every variant of every
# kernel compiled by NVRTC for sm_80 and sm_90 (nvrtc_all_variants with
# KIVI_FULL_SWEEP=1; CI compiles a sample of them), with NVRTC provisioned
# by scripts/provision-cuda.sh.
#
# Usage: scripts/full-sweep.sh [LOG_DIR]     (default target/full-sweep)
# Builds in the dev profile (optimised, see Cargo.toml), so it reuses what
# scripts/test.sh built; the kernels themselves are compiled by the shim.
# Prints each run's test counts and the "N variants ..." lines the tests
# report; exits non-zero if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
logs="${1:-target/full-sweep}"
mkdir -p "$logs"
tests=(--test sim_variants --test sim_schemes --test sim_extend --test sim_smoke
       --test device_decode --test device_extend --test device_codecs --test device_block --test sim_barriers --test sim_strict
       --test sim_low_rank --test sim_vq --test sim_minmax)
failed=0
start=$SECONDS
for sched in inorder reverse 1 2; do
    log="$logs/sched-$sched.log"
    echo "==> KIVI_SIM_SCHEDULE=$sched"
    if KIVI_FULL_SWEEP=1 KIVI_SIM_SCHEDULE="$sched" cargo test -p kivi-runtime "${tests[@]}" -- --nocapture >"$log" 2>&1; then
        echo "    ok"
    else
        echo "    FAILED (see $log)"
        failed=$((failed + 1))
    fi
    grep -E '^test result' "$log" | awk '{p+=$4; f+=$6} END {printf "    %d tests passed, %d failed\n", p, f}'
    grep -E '^(sim|cuda): ' "$log" | sed 's/^/    /' | sort -u | head -20
done
runs=4
if [ -f scripts/provision-cuda.sh ]; then
    runs=5
    log="$logs/nvrtc-all-variants.log"
    echo "==> nvrtc_all_variants, every variant (KIVI_FULL_SWEEP=1)"
    if bash scripts/provision-cuda.sh --quiet >"$log" 2>&1 &&
        (. .cache/nvidia/env.sh && KIVI_REQUIRE_NVRTC=1 KIVI_FULL_SWEEP=1 \
            cargo test -p kivi-runtime --test nvrtc_all_variants -- --nocapture) >>"$log" 2>&1; then
        echo "    ok"
    else
        echo "    FAILED (see $log)"
        failed=$((failed + 1))
    fi
    grep -E '^(nvrtc|  )' "$log" | sed 's/^/    /' | head -8
fi
echo "full sweep: $((SECONDS - start)) s, $failed of $runs runs failed"
[ "$failed" -eq 0 ]
