#!/usr/bin/env bash
# Instructions per call of braid's small-call path, counted exactly by
# callgrind: on a VM without hardware counters, and with phases that move
# a 0.1 µs call by 2x, the one measure of the call path that does not
# drift (docs/performance.md, "Counting instructions instead").
#
#   scripts/call-instructions.sh [COLL ...]     (default: broadcast reduce all_reduce)
#
# Each collective runs as braid-perf on one rank, 8 bytes, N timed calls out
# of place and N in place (N=100000 by default), without the result check;
# the count is the rank's whole process (start-up and braid-perf's loop
# included, a few instructions a call) over its 2N + 20 calls.
# PERF=/path/to/braid-perf measures that binary instead of building this
# tree's (to compare two builds). NP=2 runs two ranks and prints each one's
# count (the root's, Broadcast and Reduce, first; the ranks' processes run
# under valgrind side by side). Installs valgrind if missing (apt-get).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
n=${N:-100000}
np=${NP:-1}
colls=("$@")
[ ${#colls[@]} -gt 0 ] || colls=(broadcast reduce all_reduce)
command -v valgrind >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null; }
if [ -n "${PERF:-}" ]; then
    perf=$PERF
else
    cargo build --release -q -p braid-perf --manifest-path "$here/Cargo.toml"
    perf=${CARGO_TARGET_DIR:-$here/target}/release/braid-perf
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "# $(date -u +%FT%TZ) $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?') $perf, $np rank(s), 8 bytes, $n calls each way"
echo "# collective  instructions/call (per rank, rank 0 first)"
for c in "${colls[@]}"; do
    rm -f "$out"/cg.*
    valgrind --tool=callgrind --trace-children=yes --callgrind-out-file="$out/cg.%p" \
        "$perf" "$c" -np "$np" -b 8 -e 8 -n "$n" -w 10 -c 0 >"$out/log" 2>&1 ||
        { cat "$out/log" >&2; exit 1; }
    # Each rank's profile names it on its command line (--child-rank R).
    counts=()
    for r in $(seq 0 $((np - 1))); do
        f=$(grep -l -- "--child-rank $r " "$out"/cg.* 2>/dev/null | head -1 || true)
        [ -n "$f" ] || f=$(ls -S "$out"/cg.* | head -1)
        total=$(callgrind_annotate "$f" 2>/dev/null | awk '/PROGRAM TOTALS/ && !t { gsub(",", "", $1); t = $1 } END { print t }')
        counts+=("$(awk -v t="$total" -v k=$((2 * n + 20)) 'BEGIN { printf "%.0f", t / k }')")
    done
    printf '%-12s %s\n' "$c" "${counts[*]}"
done
