#!/usr/bin/env bash
# Fuzz every wire decoder for a fixed time on its corpus (see README,
# "Fuzzing"). Usage:
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Installs cargo-fuzz if missing, builds all targets (libFuzzer, AddressSanitizer,
# debug assertions), runs each for SECONDS_PER_TARGET (default 30) on a
# temporary copy of fuzz/corpus/<target> (the repository is not written),
# prints a summary table and exits non-zero if any target crashed, leaked,
# timed out or ran out of memory. Crashing inputs are copied to
# fuzz/artifacts/<target>/ (ignored by git) with the command to reproduce.
#
# Environment: FUZZ_RSS_MB (default 1536) and FUZZ_MALLOC_MB (default 128)
# are libFuzzer's -rss_limit_mb and -malloc_limit_mb, so one unbounded
# allocation is a failure; FUZZ_TIMEOUT (default 10) is seconds per input;
# FUZZ_TARGET_DIR (default fuzz/target) is where the targets are built (CI
# keeps it outside its fresh clone, so that later runs build incrementally).
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-30}
shift || true
if ! [[ $secs =~ ^[0-9]+$ ]] || [ "$secs" -eq 0 ]; then
    echo "usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]" >&2
    exit 2
fi
rss=${FUZZ_RSS_MB:-1536}
malloc=${FUZZ_MALLOC_MB:-128}
per_input=${FUZZ_TIMEOUT:-10}
target_dir=${FUZZ_TARGET_DIR:-fuzz/target}
mkdir -p "$target_dir"
target_dir=$(cd "$target_dir" && pwd)

# cargo fuzz passes nightly-only flags (-Zsanitizer=address); a stable
# toolchain accepts them with RUSTC_BOOTSTRAP=1.
export RUSTC_BOOTSTRAP=1

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    # A debug build of the driver: it only runs cargo, and builds in half the time.
    cargo install cargo-fuzz --locked --debug --quiet
fi

mapfile -t all < <(cd fuzz/fuzz_targets && ls -- *.rs | sed 's/\.rs$//')
if [ $# -gt 0 ]; then targets=("$@"); else targets=("${all[@]}"); fi
for t in "${targets[@]}"; do
    if [ ! -d "fuzz/corpus/$t" ]; then
        echo "no fuzz target $t (targets: ${all[*]})" >&2
        exit 2
    fi
done

echo "== building ${#targets[@]} fuzz targets"
start=$(date +%s)
# --debug-assertions: overflow checks too, so arithmetic on lengths from the wire is checked.
if [ ${#targets[@]} -eq ${#all[@]} ]; then
    cargo fuzz build --debug-assertions --target-dir "$target_dir"
else
    for t in "${targets[@]}"; do
        cargo fuzz build --debug-assertions --target-dir "$target_dir" "$t"
    done
fi
host=$(rustc -vV | sed -n 's/^host: //p')
bindir="$target_dir/$host/release"
for t in "${targets[@]}"; do
    if [ ! -x "$bindir/$t" ]; then
        echo "fuzz target $t did not build" >&2
        exit 1
    fi
done
echo "   built in $(($(date +%s) - start))s"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
rows=()
for t in "${targets[@]}"; do
    cp -r "fuzz/corpus/$t" "$work/corpus-$t"
    mkdir -p "$work/artifacts-$t"
    log="$work/log-$t"
    t0=$(date +%s)
    set +e
    "$bindir/$t" -max_total_time="$secs" -rss_limit_mb="$rss" -malloc_limit_mb="$malloc" \
        -timeout="$per_input" -print_final_stats=1 \
        -artifact_prefix="$work/artifacts-$t/" "$work/corpus-$t" >"$log" 2>&1
    rc=$?
    set -e
    took=$(($(date +%s) - t0))
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    runs=${runs:-?}
    if [ $rc -eq 0 ]; then
        result=ok
    else
        failed=1
        result=$(grep -oE 'ERROR: (libFuzzer|AddressSanitizer): [a-z-]+' "$log" | head -1 | sed 's/^ERROR: //')
        result="FAILED (${result:-exit $rc})"
        mkdir -p "fuzz/artifacts/$t"
        cp "$work/artifacts-$t/"* "fuzz/artifacts/$t/" 2>/dev/null || true
        echo "---- $t failed; the end of its log:"
        tail -n 60 "$log"
        for a in "fuzz/artifacts/$t/"*; do
            [ -e "$a" ] || continue
            echo "---- reproduce (from the repository root): RUSTC_BOOTSTRAP=1 cargo fuzz run --debug-assertions $t $a"
        done
    fi
    rows+=("$(printf '%-22s %12s %8s  %s' "$t" "$runs" "$took" "$result")")
done

echo
echo "== fuzz summary (${secs}s per target, rss ${rss} MB, malloc ${malloc} MB)"
printf '%-22s %12s %8s  %s\n' target runs seconds result
printf '%s\n' "${rows[@]}"
echo "   total $(($(date +%s) - start))s"
exit $failed
