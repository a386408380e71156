#!/usr/bin/env bash
# braid-perf and Open MPI's shared-memory collectives on busy CPUs, side by
# side: one busy process per core (what a training step's compute does to
# the collectives beside it) runs for the whole benchmark, and braid and
# Open MPI alternate sweep by sweep under the same load. Prints the median
# time per size of each and the ratio (Open MPI's time / braid's: above 1,
# braid is faster).
#
#   scripts/contention-bench.sh [NP] [ROUNDS]        (default 2 ranks, 3 rounds)
#
# COLLS="all_reduce all_gather" (default: all_reduce all_gather
# reduce_scatter broadcast), SIZES (default 8 to 64M, x8 steps), LOAD=0 runs
# the same comparison on idle CPUs, LOAD=N starts N busy processes (default:
# one per core). PERF=/path/to/braid-perf runs that binary. Open MPI runs in
# its fastest configuration here (vader BTL, glibc malloc on transparent huge
# pages, as tools/peers/mpi-best.sh; tools/peers/mpi_coll_bench.c, or the one
# in PEERS=DIR); both bind rank r to core r (mpirun's default for 2 ranks,
# braid-perf's --bind core). Both use user buffers on
# transparent huge pages (-H 1), and braid is told so as in compare-mpi.sh
# (BRAID_SINGLE_COPY_MIN_BYTES=524288 unless set).
set -euo pipefail
np=${1:-2}
rounds=${2:-3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
peers=${PEERS:-$here/tools/peers}
colls=${COLLS:-all_reduce all_gather reduce_scatter broadcast}
sizes=${SIZES:-8 64 512 4K 32K 256K 2M 16M 64M}
cores=$(nproc)
load=${LOAD:-$cores}
if [ -n "${PERF:-}" ]; then
    perf=$PERF
else
    cargo build --release -q -p braid-perf --manifest-path "$here/Cargo.toml"
    perf=$here/target/release/braid-perf
fi
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi
build=${PEERS_BUILD:-/tmp/peers-build}
mkdir -p "$build"
[ "$build/mpi_coll_bench" -nt "$peers/mpi_coll_bench.c" ] ||
    mpicc -O2 "$peers/mpi_coll_bench.c" -o "$build/mpi_coll_bench"
export BRAID_SINGLE_COPY_MIN_BYTES=${BRAID_SINGLE_COPY_MIN_BYTES:-524288}
declare -A mpiname=([all_reduce]=allreduce [all_gather]=allgather [reduce_scatter]=reducescatter
    [broadcast]=bcast [reduce]=reduce [alltoall]=alltoall)
out=$(mktemp -d)
busy=()
cleanup() {
    for p in "${busy[@]}"; do kill "$p" 2>/dev/null || true; done
    rm -rf "$out"
}
trap cleanup EXIT
for _ in $(seq "$load"); do
    sh -c 'while :; do :; done' &
    busy+=($!)
done
bytes() {
    local s=$1 m=1
    case $s in *K) m=1024 s=${s%K} ;; *M) m=1048576 s=${s%M} ;; *G) m=1073741824 s=${s%G} ;; esac
    echo $((s * m))
}
echo "# $(date -u '+%Y-%m-%d %H:%M') $np ranks, $load busy processes on $cores CPUs, $rounds rounds (braid and Open MPI alternate)"
for c in $colls; do
    for round in $(seq "$rounds"); do
        for s in $sizes; do
            n=$(bytes "$s")
            # nccl-tests' sizes: the whole array for AllGather/ReduceScatter.
            # Both sides time each size for 0.2 s (braid -D, the MPI
            # benchmark -T without its 2000-iteration cap), so both average
            # over as many scheduler slices: a few hundred iterations of an
            # 8-byte call last under a millisecond, one slice or none.
            iters=$((n >= 16777216 ? 3 : n >= 1048576 ? 10 : 100))
            "$perf" "$c" -np "$np" -b "$s" -e "$s" -n "$iters" -D 0.2 -w 3 -H 1 2>/dev/null |
                awk -v s="$n" '/^ +[0-9]/ {print s, $6; exit}' >>"$out/braid_$c"
        done
        mpirun --allow-run-as-root --oversubscribe --mca pml ob1 --mca btl vader,self \
            -x GLIBC_TUNABLES=glibc.malloc.hugetlb=1 -np "$np" \
            "$build/mpi_coll_bench" -c "${mpiname[$c]}" -l "$(echo "$sizes" | tr ' ' ',')" -T 0.2 -n 100000000 -H 1 2>/dev/null |
            awk '/^ +[0-9]/ {print $1, $6}' >>"$out/mpi_$c"
    done
    echo "# $c: median time per call (us)"
    printf '# %10s  %10s  %10s  %7s\n' size braid openmpi ratio
    python3 - "$out/braid_$c" "$out/mpi_$c" <<'EOF'
import statistics, sys
def load(p):
    d = {}
    for line in open(p):
        s, t = line.split()
        d.setdefault(int(s), []).append(float(t))
    return d
b, m = load(sys.argv[1]), load(sys.argv[2])
for s in sorted(b):
    tb = statistics.median(b[s])
    tm = statistics.median(m[s]) if s in m else float("nan")
    print(f"  {s:>10}  {tb:>10.2f}  {tm:>10.2f}  {tm / tb:>7.2f}")
EOF
done
