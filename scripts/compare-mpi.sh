#!/usr/bin/env bash
# braid-perf and Open MPI's shared-memory collectives, side by side in one run
# on this host, and a table of busbw ratios (braid / Open MPI).
#
#   scripts/compare-mpi.sh OUTDIR [NPS] [ITERS]     (ROUNDS=2: alternations)
#
# COLLS="all_reduce all_gather" limits the collectives (default: all six);
# PERF=/path/to/braid-perf runs that binary instead of building this tree's
# (to compare two builds of braid against Open MPI, one after the other).
#
# braid's buffers are 2 MiB-aligned with madvise(MADV_HUGEPAGE) (-H 1), and
# braid is told so: BRAID_SINGLE_COPY_MIN_BYTES=524288 (unless set), what
# braid uses by itself where THP is `always` and what a caller with
# huge-page buffers under THP `madvise` should set (see
# single_copy_default in crates/runtime/src/comm/tuning.rs: on 4 KiB pages
# process_vm_readv is 3x slower, so the default there is 8 MiB). Open MPI
# runs in its fastest configuration here (vader BTL, glibc malloc on
# transparent huge pages): tools/peers/mpi-best.sh, or the one in PEERS=DIR.
# Run it on an otherwise idle machine.
set -euo pipefail
out=${1:?usage: compare-mpi.sh OUTDIR [NPS] [ITERS]}; mkdir -p "$out"
nps=${2:-2 4}
iters=${3:-20}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
peers=${PEERS:-$here/tools/peers}
colls=${COLLS:-all_reduce all_gather reduce_scatter broadcast reduce alltoall}
if [ -n "${PERF:-}" ]; then
  perf=$PERF
else
  cargo build --release -q -p braid-perf --manifest-path "$here/Cargo.toml"
  perf=$here/target/release/braid-perf
fi
export BRAID_SINGLE_COPY_MIN_BYTES=${BRAID_SINGLE_COPY_MIN_BYTES:-524288}
# Alternate braid and Open MPI collective by collective (seconds apart: this
# machine switches between a fast and a slow mode minutes apart), ROUNDS
# times, so that both meet the same machine; the table keeps each side's
# best round.
declare -A mpiname=([all_reduce]=allreduce [all_gather]=allgather [reduce_scatter]=reducescatter
  [broadcast]=bcast [reduce]=reduce [alltoall]=alltoall)
rounds=${ROUNDS:-2}
for round in $(seq "$rounds"); do
  for np in $nps; do
    mkdir -p "$out/mpi_np$np.r$round"
    rm -f "$out/mpi_np$np.r$round/mpi.csv"
    for c in $colls; do
      # The latency point: 8 bytes, or where the size is the whole array the
      # smallest one braid-perf runs (16 bytes per rank, as nccl-tests
      # rounds; Open MPI's benchmark runs one float per rank there, so those
      # points are plotted but not tabled).
      small=8
      case $c in all_gather | reduce_scatter | alltoall) small=$((16 * np)) ;; esac
      "$perf" "$c" -np "$np" -b "$small" -e "$small" -n 2000 -w 100 -H 1 -J "$out/braid_${c}_np${np}_small.r$round.json" >/dev/null
      "$perf" "$c" -np "$np" -b 1M -e 64M -f 4 -n "$iters" -w 3 -H 1 -J "$out/braid_${c}_np${np}.r$round.json" >"$out/braid_${c}_np${np}.r$round.txt"
      # The table's cells: one run per size with its own warm-up and, as
      # Open MPI's timed loop (~0.2 s per size), many more iterations than the
      # sweep above (which follows nccl-tests: warm-up only at its ends, and
      # whose 20 iterations at 16 MiB, right after 4 MiB, ranged 0.8-1.7 ms
      # for AllGather on 2 ranks where a run of its own gave 0.8-1.0).
      for cell in 1M:300:20 16M:100:10 64M:30:3; do
        IFS=: read -r size n w <<<"$cell"
        "$perf" "$c" -np "$np" -b "$size" -e "$size" -n "$n" -w "$w" -H 1 -J "$out/braid_${c}_np${np}_$size.r$round.json" >/dev/null
        # The moving collectives once more on registered buffers (-R 1:
        # braid::HostBuffer, which peers map and copy from without
        # process_vm_readv): a column of its own, next to the plain one.
        case $c in all_gather | broadcast | alltoall)
          "$perf" "$c" -np "$np" -b "$size" -e "$size" -n "$n" -w "$w" -R 1 -J "$out/braid_${c}_np${np}_$size.reg.r$round.json" >/dev/null ;;
        esac
      done
      part=$out/parts/mpi_np$np.r$round.$c
      "$peers/mpi-best.sh" "$part" "$np" "${mpiname[$c]}" 8,1M,16M,64M >/dev/null
      # One file per rank count and round, as for a single mpi-best run.
      if [ -f "$out/mpi_np$np.r$round/mpi.csv" ]; then
        tail -n +2 "$part/mpi.csv" >>"$out/mpi_np$np.r$round/mpi.csv"
      else
        cp "$part/mpi.csv" "$out/mpi_np$np.r$round/mpi.csv"
      fi
    done
  done
done
python3 - "$out" <<'PY'
import csv, glob, json, os, statistics, sys
out = sys.argv[1]
name = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter",
        "broadcast": "bcast", "reduce": "reduce", "alltoall": "alltoall"}
# Every round's time per cell, each side. braid's 1, 16 and 64 MiB cells
# come from their runs of their own only (the sweep is for the plots).
mpi, braid, reg = {}, {}, {}
for f in glob.glob(os.path.join(out, "mpi_np*.r*", "mpi.csv")):
    for row in csv.DictReader(open(f)):
        key = (row["coll"], int(row["nranks"]), int(row["size"]))
        mpi.setdefault(key, []).append(float(row["time_us"]))
for f in sorted(glob.glob(os.path.join(out, "braid_*.r*.json"))):
    base = os.path.basename(f)
    cell_run = any(f"_{s}." in base for s in ("1M", "16M", "64M"))
    into = reg if ".reg." in base else braid
    for r in json.load(open(f))["rows"]:
        if r["size"] in (1 << 20, 16 << 20, 64 << 20) and not cell_run:
            continue
        # Like with like: MPI_Bcast works in place, the others out of place.
        side = r["in_place"] if r["collective"] == "broadcast" else r["out_of_place"]
        if side["time_us"]:
            into.setdefault((r["collective"], r["nranks"], r["size"]), []).append(side["time_us"])
print(f"{'collective':15} {'np':>3} {'size':>9} {'braid us':>9} {'mpi us':>9} {'best':>6} {'median':>7}"
      f" {'-R1 us':>9} {'best':>6} {'median':>7}")
for (c, n, size), ts in sorted(braid.items()):
    key = (name[c], n, size)
    # MPI's 8-byte AllGather/AllToAll rows hold one element per rank.
    if key not in mpi and size == 8:
        key = (key[0], n, 4 * n)
    if key not in mpi:
        continue
    ms = mpi[key]
    # Same bytes on both sides, so busbw ratio = time ratio (MPI / braid).
    best, med = min(ms) / min(ts), statistics.median(ms) / statistics.median(ts)
    line = f"{c:15} {n:>3} {size:>9} {min(ts):>9.2f} {min(ms):>9.2f} {best:>6.2f} {med:>7.2f}"
    rs = reg.get((c, n, size))
    if rs:
        line += (f" {min(rs):>9.2f} {min(ms) / min(rs):>6.2f}"
                 f" {statistics.median(ms) / statistics.median(rs):>7.2f}")
    print(line)
rounds = os.environ.get("ROUNDS", "2")
print(f"{rounds} alternating rounds per side; us: each side's best round; best: ratio of the best rounds, "
      f"median: of the median rounds; ratio = Open MPI's time / braid's (= busbw braid / Open MPI); "
      f"out of place, Broadcast in place (as MPI_Bcast)")
print(f"both sides on 2 MiB huge pages; braid with BRAID_SINGLE_COPY_MIN_BYTES={os.environ.get('BRAID_SINGLE_COPY_MIN_BYTES')}")
print("-R1: braid's moving collectives on registered buffers (braid-perf -R 1: braid::HostBuffer, "
      "a shared memory file on the system's shmem pages; peers copy from it without process_vm_readv)")
PY
# Plots: braid's last round against Open MPI's, one picture per collective
# and rank count (busbw and latency against size).
for np in $nps; do
  "$perf" import-mpi "$out/mpi_np$np.r$rounds/mpi.csv" --label "Open MPI" -o "$out/mpi_np$np.json" >/dev/null
  for c in $colls; do
    inplace=(); [ "$c" = broadcast ] && inplace=(--in-place)
    # One braid series from 8 bytes up: the 8-byte run's rows join the
    # sweep's, whose 1, 16 and 64 MiB points give way to the table's runs.
    r="$out/braid_${c}_np${np}"
    python3 - "$r.plot.json" "$r.r$rounds.json" "${r}_small.r$rounds.json" \
      "${r}_1M.r$rounds.json" "${r}_16M.r$rounds.json" "${r}_64M.r$rounds.json" <<'PY'
import json, sys
sweep, *own = (json.load(open(f)) for f in sys.argv[2:])
mine = {r["size"] for o in own for r in o["rows"]}
sweep["rows"] = sorted([r for r in sweep["rows"] if r["size"] not in mine]
                       + [r for o in own for r in o["rows"]], key=lambda r: r["size"])
json.dump(sweep, open(sys.argv[1], "w"))
PY
    # The moving collectives' -R 1 cells as a third series.
    reg=()
    if [ -f "${r}_1M.reg.r$rounds.json" ]; then
      python3 - "$r.reg.plot.json" "${r}_1M.reg.r$rounds.json" "${r}_16M.reg.r$rounds.json" \
        "${r}_64M.reg.r$rounds.json" <<'PY'
import json, sys
runs = [json.load(open(f)) for f in sys.argv[2:]]
out = runs[0]
out["label"] = "braid -R 1"
out["rows"] = sorted((r for o in runs for r in o["rows"]), key=lambda r: r["size"])
json.dump(out, open(sys.argv[1], "w"))
PY
      reg=("$r.reg.plot.json")
    fi
    "$perf" plot "$out/braid_${c}_np${np}.plot.json" "${reg[@]}" "$out/mpi_np$np.json" --coll "$c" "${inplace[@]}" \
      --title "$c, $np ranks, one host" -o "$out/${c}_np$np.png" >/dev/null
  done
done
echo "plots: $out/*_np*.png"
