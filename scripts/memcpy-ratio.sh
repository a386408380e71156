#!/usr/bin/env bash
# Issue 32 item 5: a collective's algbw against the bandwidth of one memcpy
# of the same size, measured side by side in one run: each round runs the
# best of 20 memcpys (scripts/memcpy-best.c) and braid-perf on 2 local
# ranks, alternating, and the script prints every round, the medians and
# the ratio median(algbw) / median(memcpy). With OLD set to another
# braid-perf binary (say, built from main into another target directory),
# every round runs it too, right after the new one, for an old/new
# comparison on the same machine state.
#
#   scripts/memcpy-ratio.sh [ROUNDS]            (default 5)
#
# Environment: BENCH (all_reduce), SIZE (64M), NP (2), OLD (a braid-perf
# binary to compare), PERF (the braid-perf to measure; default: built here
# with cargo build --release -p braid-perf into CARGO_TARGET_DIR or
# target/), ARGS (more braid-perf options, e.g. "-H 1").
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rounds=${1:-5}
bench=${BENCH:-all_reduce}
size=${SIZE:-64M}
np=${NP:-2}
if [ -z "${PERF:-}" ]; then
    cargo build --release -q -p braid-perf --manifest-path "$here/Cargo.toml"
    PERF=${CARGO_TARGET_DIR:-$here/target}/release/braid-perf
fi
bytes=$(numfmt --from=iec "$size")
mc=$(mktemp -d)/memcpy-best
cc -O2 "$here/scripts/memcpy-best.c" -o "$mc"

# algbw (GB/s) of the out-of-place column of one braid-perf run.
algbw() {
    # shellcheck disable=SC2086
    "$1" "$bench" -np "$np" -b "$size" -e "$size" -n 20 -w 2 ${ARGS:-} |
        awk '!/^#/ && NF >= 8 { print $8; exit }'
}

median() {
    sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

declare -a m n o
echo "# $(date -u +%FT%TZ) $(git -C "$here" rev-parse --short HEAD) $bench $size np=$np rounds=$rounds ${ARGS:-}"
echo "# round  memcpy_GB/s  new_algbw  new/memcpy${OLD:+  old_algbw  old/memcpy}"
for r in $(seq 1 "$rounds"); do
    m[r]=$("$mc" "$bytes" 20)
    n[r]=$(algbw "$PERF")
    line="$r  ${m[r]}  ${n[r]}  $(awk -v a="${n[r]}" -v b="${m[r]}" 'BEGIN { printf "%.3f", a / b }')"
    if [ -n "${OLD:-}" ]; then
        o[r]=$(algbw "$OLD")
        line+="  ${o[r]}  $(awk -v a="${o[r]}" -v b="${m[r]}" 'BEGIN { printf "%.3f", a / b }')"
    fi
    echo "$line"
done
mm=$(printf '%s\n' "${m[@]}" | median)
nm=$(printf '%s\n' "${n[@]}" | median)
out="median  memcpy $mm GB/s  new algbw $nm GB/s  ratio $(awk -v a="$nm" -v b="$mm" 'BEGIN { printf "%.3f", a / b }')"
if [ -n "${OLD:-}" ]; then
    om=$(printf '%s\n' "${o[@]}" | median)
    out+="  old algbw $om GB/s  ratio $(awk -v a="$om" -v b="$mm" 'BEGIN { printf "%.3f", a / b }')"
fi
echo "$out"
