#!/usr/bin/env bash
# What a rank holds, measured for real: N ranks on this host over shared
# memory and over forced sockets, one braid-scale process per rank started by
# braid-run. One row per (transport, N):
#
#   peak shared memory (all ranks, /dev/shm used, sampled every 5 ms by rank 0),
#   threads and resident memory per rank (the most of any rank, after the
#   operations; "peak" is VmHWM), init time (the slowest rank's
#   Communicator::from_env), 8-byte and 1 MiB AllReduce time (rank 0's mean).
#
#   scripts/scale-table.sh [-b BINDIR] [-l LABEL] [-n "8 16 32 48"] [-t "shm socket"]
#
# BINDIR holds braid-run and braid-scale (default: target/release, built
# first). To compare with another version, build those two binaries from it
# (e.g. a worktree of main) and pass its folder: braid-scale uses only the
# public API, so its source builds against any braid since 12a8151.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=""
label=$(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo "?")
ns="8 16 32 48"
ts="shm socket"
while getopts "b:l:n:t:" o; do
    case $o in
        b) bin=$OPTARG ;;
        l) label=$OPTARG ;;
        n) ns=$OPTARG ;;
        t) ts=$OPTARG ;;
        *) sed -n '2,17p' "$0"; exit 2 ;;
    esac
done
if [ -z "$bin" ]; then
    CARGO_INCREMENTAL=0 cargo build --release -q --manifest-path "$here/Cargo.toml" \
        -p braid-run -p braid-tests --bin braid-scale
    bin=$here/target/release
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
printf '| version | transport | ranks | peak shm MiB | threads/rank | RSS/rank MiB | peak RSS/rank MiB | init ms | 8 B AllReduce us | 1 MiB AllReduce us |\n'
printf '| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n'
for t in $ts; do
    for n in $ns; do
        envs=(BRAID_TIMEOUT=120)
        [ "$t" = socket ] && envs+=(BRAID_TRANSPORT=socket)
        f=$out/$t-$n
        if ! env "${envs[@]}" timeout 900 "$bin/braid-run" -n "$n" -- "$bin/braid-scale" 200 20 \
            >"$f" 2>"$f.err"; then
            printf '| %s | %s | %d | failed: %s |||||||\n' "$label" "$t" "$n" \
                "$(grep -m1 -i error "$f.err" "$f" | cut -c1-120 || true)"
            continue
        fi
        python3 - "$f" "$label" "$t" "$n" <<'EOF'
import re, statistics, sys
path, label, t, n = sys.argv[1:]
rows = []
for line in open(path):
    m = line.find("scale rank=")
    if m >= 0:
        rows.append(dict(kv.split("=") for kv in line[m:].split()[1:]))
if len(rows) != int(n):
    print(f"| {label} | {t} | {n} | only {len(rows)} ranks reported |||||||")
    sys.exit(0)
r0 = next(r for r in rows if r["rank"] == "0")
mx = lambda k: max(float(r[k]) for r in rows)
print(f"| {label} | {t} | {n} | {float(r0['shm_peak_kib'])/1024:.0f} | {mx('threads'):.0f} | "
      f"{mx('rss_kib')/1024:.0f} | {mx('hwm_kib')/1024:.0f} | {mx('init_ms'):.0f} | "
      f"{float(r0['ar8_us']):.1f} | {float(r0['ar1m_us']):.0f} |")
EOF
        left=$(ls /dev/shm | grep -c '^braid-' || true)
        [ "$left" = 0 ] || echo "warning: $left braid segments left in /dev/shm" >&2
    done
done
