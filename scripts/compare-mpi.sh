#!/usr/bin/env bash
# braid-perf and Open MPI's shared-memory collectives, side by side in one run
# on this host, and a table of busbw ratios (braid / Open MPI).
#
#   scripts/compare-mpi.sh OUTDIR [NPS] [ITERS]
#
# braid's buffers get madvise(MADV_HUGEPAGE) (-H 1); Open MPI runs in its
# fastest configuration here (../shared/peers/mpi-best.sh: vader BTL, glibc
# malloc on transparent huge pages). Run it on an otherwise idle machine.
set -euo pipefail
out=${1:?usage: compare-mpi.sh OUTDIR [NPS] [ITERS]}; mkdir -p "$out"
nps=${2:-2 4}
iters=${3:-20}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
peers=${PEERS:-$here/../shared/peers}
cargo build --release -q -p braid-perf --manifest-path "$here/Cargo.toml"
perf=$here/target/release/braid-perf
for np in $nps; do
  for c in all_reduce all_gather reduce_scatter broadcast reduce alltoall; do
    "$perf" "$c" -np "$np" -b 8 -e 8 -n 2000 -w 100 -H 1 -J "$out/braid_${c}_np${np}_small.json" >/dev/null
    "$perf" "$c" -np "$np" -b 1M -e 64M -f 4 -n "$iters" -w 3 -H 1 -J "$out/braid_${c}_np${np}.json" >"$out/braid_${c}_np${np}.txt"
  done
done
"$peers/mpi-best.sh" "$out/mpi" "$nps" allreduce,allgather,reducescatter,bcast,reduce,alltoall 8,1M,16M,64M >/dev/null
python3 - "$out" <<'PY'
import csv, glob, json, os, sys
out = sys.argv[1]
name = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter",
        "broadcast": "bcast", "reduce": "reduce", "alltoall": "alltoall"}
mpi = {}
for row in csv.DictReader(open(os.path.join(out, "mpi", "mpi.csv"))):
    mpi[(row["coll"], int(row["nranks"]), int(row["size"]))] = (float(row["busbw_GBps"]), float(row["time_us"]))
rows = []
for f in sorted(glob.glob(os.path.join(out, "braid_*.json"))):
    for r in json.load(open(f))["rows"]:
        # Like with like: MPI_Bcast works in place, the others out of place.
        side = r["in_place"] if r["collective"] == "broadcast" else r["out_of_place"]
        best, t = side["busbw_gbps"] or 0.0, side["time_us"] or 0.0
        key = (name[r["collective"]], r["nranks"], r["size"])
        # MPI's 8-byte AllGather/AllToAll rows hold one element per rank.
        if key not in mpi and r["size"] == 8:
            key = (key[0], key[1], 4 * r["nranks"])
        if key in mpi:
            rows.append((r["collective"], r["nranks"], r["size"], t, best, *mpi[key]))
print(f"{'collective':15} {'np':>3} {'size':>9} {'braid us':>9} {'braid busbw':>11} {'mpi us':>9} {'mpi busbw':>9} {'ratio':>6}")
for c, n, s, t, b, mb, mt in sorted(rows):
    ratio = b / mb if s > 8 else mt / t
    print(f"{c:15} {n:>3} {s:>9} {t:>9.2f} {b:>11.2f} {mt:>9.2f} {mb:>9.2f} {ratio:>6.2f}")
print("ratio: busbw braid/mpi (out of place; Broadcast in place, as MPI_Bcast); for 8 bytes: time mpi/braid")
PY
