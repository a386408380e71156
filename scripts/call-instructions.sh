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
# tree's (to compare two builds). Installs valgrind if missing (apt-get).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
n=${N:-100000}
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
echo "# $(date -u +%FT%TZ) $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?') $perf, 1 rank, 8 bytes, $n calls each way"
echo "# collective  instructions/call"
for c in "${colls[@]}"; do
    rm -f "$out"/cg.*
    valgrind --tool=callgrind --trace-children=yes --callgrind-out-file="$out/cg.%p" \
        "$perf" "$c" -np 1 -b 8 -e 8 -n "$n" -w 10 -c 0 >"$out/log" 2>&1 ||
        { cat "$out/log" >&2; exit 1; }
    # The rank is the process that ran the calls: the largest profile.
    f=$(ls -S "$out"/cg.* | head -1)
    total=$(callgrind_annotate "$f" 2>/dev/null | awk '/PROGRAM TOTALS/ && !t { gsub(",", "", $1); t = $1 } END { print t }')
    awk -v c="$c" -v t="$total" -v k=$((2 * n + 20)) 'BEGIN { printf "%-12s %8.0f\n", c, t / k }'
done
