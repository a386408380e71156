#!/usr/bin/env bash
# What the mismatch check (one 64-byte header per link per operation) costs:
# braid-perf AllReduce with the check on and off (BRAID_CHECK_MISMATCH=0),
# alternated ROUNDS times in one run so both meet the same machine; prints
# each side's best 8-byte time and 64 MiB busbw, and their ratios.
#
#   scripts/mismatch-overhead.sh [NP] [ROUNDS]
set -euo pipefail
np=${1:-2}
rounds=${2:-5}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cargo build --release -q -p braid-perf --manifest-path "$here/Cargo.toml"
perf=$here/target/release/braid-perf
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for r in $(seq "$rounds"); do
    for check in 1 0; do
        BRAID_CHECK_MISMATCH=$check "$perf" all_reduce -np "$np" -b 8 -e 8 -n 5000 -w 200 \
            -J "$out/small.$check.$r.json" >/dev/null
        BRAID_CHECK_MISMATCH=$check "$perf" all_reduce -np "$np" -b 64M -e 64M -n 10 -w 2 -H 1 \
            -J "$out/large.$check.$r.json" >/dev/null
    done
done
python3 - "$out" "$np" "$rounds" <<'PY'
import glob, json, os, sys
out, np_, rounds = sys.argv[1], sys.argv[2], sys.argv[3]
def best(kind, check, field, pick):
    vals = []
    for f in glob.glob(os.path.join(out, f"{kind}.{check}.*.json")):
        for r in json.load(open(f))["rows"]:
            vals.append(r["out_of_place"][field])
    return pick(vals)
t_on, t_off = best("small", 1, "time_us", min), best("small", 0, "time_us", min)
b_on, b_off = best("large", 1, "busbw_gbps", max), best("large", 0, "busbw_gbps", max)
print(f"AllReduce, {np_} ranks, best of {rounds} alternated runs per side")
print(f"{'':10}{'check on':>12}{'check off':>12}{'on/off':>9}")
print(f"{'8 B (us)':10}{t_on:12.2f}{t_off:12.2f}{t_on / t_off:9.3f}")
print(f"{'64M GB/s':10}{b_on:12.2f}{b_off:12.2f}{b_on / b_off:9.3f}")
PY
