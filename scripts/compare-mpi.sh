#!/usr/bin/env bash
# braid against an MPI's shared-memory collectives, side by side in one run on
# this host, and a table of ratios (braid's speed / the MPI's, goal column).
#
#   scripts/compare-mpi.sh OUTDIR [NPS] [ITERS]     (ROUNDS=2: alternations)
#
# MPI=system (Debian's Open MPI 4.1, the default), openmpi5 or mpich (wheels
# from the package index, each in a venv of its own with mpi4py, installed by
# tools/peers/mpi-env.sh on first use). Two comparisons:
#   the Rust API: braid-perf against tools/peers/mpi_coll_bench.c built with
#     that MPI's mpicc (tools/peers/mpi-best.sh), one collective at a time,
#     braid then MPI, ROUNDS times;
#   the Python API (PY=1, the default for openmpi5 and mpich): braid's
#     Communicator on numpy arrays against mpi4py on the same arrays, in one
#     MPI job per rank count (scripts/mpi4py_compare.py; this tree's wheel is
#     built with maturin and installed into the MPI's venv), batches of the
#     two sides alternating, ROUNDS rounds.
# Knobs: SIZES="8 1M 16M 64M" (the table's cells; default for openmpi5 and
# mpich "8 1K 64K 1M 8M 64M"; the whole-array collectives run at least 16
# bytes per rank on both sides), COLLS="all_reduce all_gather" (default: all
# six), DURATION=SECS (how long both sides time each cell, default 0.2),
# SWEEP=1 (braid-perf's 1M..64M sweep and the plots; default for
# system only), REG=1 (the moving collectives once more on registered
# buffers, braid-perf -R 1; default for system only), PERF=/path/to/braid-perf
# (that binary instead of building this tree's), PEERS=DIR (another copy of
# tools/peers). The table gives each side's median round, the ratio of the
# medians and of the best rounds, the goal (reducing collectives 1.25,
# moving ones 1.0) and MISS where the median ratio is below it.
#
# braid's buffers are 2 MiB-aligned with madvise(MADV_HUGEPAGE) (-H 1), and
# braid is told so: BRAID_SINGLE_COPY_MIN_BYTES=524288 (unless set), what
# braid uses by itself where THP is `always` and what a caller with
# huge-page buffers under THP `madvise` should set (see
# single_copy_default in crates/runtime/src/comm/tuning.rs: on 4 KiB pages
# process_vm_readv is 3x slower, so the default there is 8 MiB). The MPI
# runs in its fastest configuration here (shared-memory transport, glibc
# malloc on transparent huge pages): tools/peers/mpi-env.sh. The Python side
# runs with braid's defaults (numpy puts arrays of 4 MiB and more on huge
# pages by itself) and the same glibc setting for both sides.
# Run it on an otherwise idle machine.
set -euo pipefail
out=${1:?usage: compare-mpi.sh OUTDIR [NPS] [ITERS]}; mkdir -p "$out"
nps=${2:-2 4}
iters=${3:-20}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
peers=${PEERS:-$here/tools/peers}
colls=${COLLS:-all_reduce all_gather reduce_scatter broadcast reduce alltoall}
export MPI=${MPI:-system}
# shellcheck source=../tools/peers/mpi-env.sh
. "$peers/mpi-env.sh"
if [ "$MPI" = system ]; then
  sizes=${SIZES:-8 1M 16M 64M}; sweep=${SWEEP:-1}; reg=${REG:-1}; py=${PY:-0}
else
  sizes=${SIZES:-8 1K 64K 1M 8M 64M}; sweep=${SWEEP:-0}; reg=${REG:-0}; py=${PY:-1}
fi
target=${CARGO_TARGET_DIR:-$here/target}
if [ -n "${PERF:-}" ]; then
  perf=$PERF
else
  cargo build --release -q -p braid-perf --manifest-path "$here/Cargo.toml"
  perf=$target/release/braid-perf
fi
if [ "$py" = 1 ]; then
  [ -n "$MPI_VENV" ] || { echo "compare-mpi: PY=1 needs MPI=openmpi5 or mpich (a venv with mpi4py)" >&2; exit 2; }
  # This tree's braid into the MPI's venv.
  maturin=${MATURIN:-$(command -v maturin || echo "$HOME/.cache/braid/wheel-build/bin/maturin")}
  if [ ! -x "$maturin" ]; then
    python3 -m venv "$HOME/.cache/braid/maturin-venv"
    "$HOME/.cache/braid/maturin-venv/bin/pip" install -q maturin
    maturin=$HOME/.cache/braid/maturin-venv/bin/maturin
  fi
  rm -rf "$out/wheel"
  (cd "$here/python" && "$maturin" build --release --quiet --out "$out/wheel" >&2)
  "$MPI_VENV/bin/pip" install -q --force-reinstall --no-deps "$out"/wheel/braid-*.whl
fi
export BRAID_SINGLE_COPY_MIN_BYTES=${BRAID_SINGLE_COPY_MIN_BYTES:-524288}
bytes() { # 8 1K 64M -> bytes
  case $1 in *K) echo $((${1%K} << 10)) ;; *M) echo $((${1%M} << 20)) ;; *G) echo $((${1%G} << 30)) ;; *) echo "$1" ;; esac
}
cell() { # COLL NP SIZE -> the size both sides run (braid-perf rounds the whole-array
  # collectives' per-rank count down to 16 bytes; at least 16 bytes per rank)
  local b; b=$(bytes "$3")
  case $1 in all_gather | reduce_scatter | alltoall)
    b=$((b / (16 * $2) * 16 * $2)); [ "$b" -ge $((16 * $2)) ] || b=$((16 * $2)) ;;
  esac
  echo "$b"
}
iters_for() { # SIZE-BYTES -> "iters warmup": each cell a run of its own with its own
  # warm-up and at least this many iterations; both sides then time each cell
  # for DURATION seconds (default 0.2: braid-perf -D, the MPI benchmark -T
  # without its 2000-iteration cap). With 2000 iterations alone an 8-byte
  # call was timed for 0.3 ms, and braid's 8-byte Broadcast read 0.15 µs in
  # one round and 0.32-0.42 in the next.
  local b=$1
  if [ "$b" -le 65536 ]; then echo "2000 100"; elif [ "$b" -le 1048576 ]; then echo "300 20"
  elif [ "$b" -le 16777216 ]; then echo "100 10"; else echo "30 3"; fi
}
# Alternate braid and the MPI collective by collective (seconds apart: this
# machine switches between a fast and a slow mode minutes apart), ROUNDS
# times, so that both meet the same machine.
declare -A mpiname=([all_reduce]=allreduce [all_gather]=allgather [reduce_scatter]=reducescatter
  [broadcast]=bcast [reduce]=reduce [alltoall]=alltoall)
rounds=${ROUNDS:-2}
duration=${DURATION:-0.2}
export MPI_SECONDS=$duration MPI_MAXITERS=100000000
rm -f "$out/load.txt"
for round in $(seq "$rounds"); do
  # The machine's load as each round starts (other work skews both sides).
  echo "round $round: load $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/load.txt"
  for np in $nps; do
    mkdir -p "$out/mpi_np$np.r$round"
    rm -f "$out/mpi_np$np.r$round/mpi.csv"
    for c in $colls; do
      if [ "$sweep" = 1 ]; then
        "$perf" "$c" -np "$np" -b 1M -e 64M -f 4 -n "$iters" -w 3 -H 1 -J "$out/braid_${c}_np${np}.r$round.json" >"$out/braid_${c}_np${np}.r$round.txt"
      fi
      mpisizes=
      for size in $sizes; do
        b=$(cell "$c" "$np" "$size")
        mpisizes=${mpisizes:+$mpisizes,}$b
        read -r n w <<<"$(iters_for "$b")"
        "$perf" "$c" -np "$np" -b "$b" -e "$b" -n "$n" -w "$w" -D "$duration" -H 1 -J "$out/braid_${c}_np${np}_$b.r$round.json" >/dev/null
        # The moving collectives once more on registered buffers (-R 1:
        # braid::HostBuffer, which peers map and copy from without
        # process_vm_readv): a column of its own, next to the plain one.
        if [ "$reg" = 1 ]; then
          case $c in all_gather | broadcast | alltoall)
            "$perf" "$c" -np "$np" -b "$b" -e "$b" -n "$n" -w "$w" -D "$duration" -R 1 -J "$out/braid_${c}_np${np}_$b.reg.r$round.json" >/dev/null ;;
          esac
        fi
      done
      part=$out/parts/mpi_np$np.r$round.$c
      "$peers/mpi-best.sh" "$part" "$np" "${mpiname[$c]}" "$mpisizes" >/dev/null
      # One file per rank count and round, as for a single mpi-best run.
      if [ -f "$out/mpi_np$np.r$round/mpi.csv" ]; then
        tail -n +2 "$part/mpi.csv" >>"$out/mpi_np$np.r$round/mpi.csv"
      else
        cp "$part/mpi.csv" "$out/mpi_np$np.r$round/mpi.csv"
      fi
    done
    if [ "$py" = 1 ]; then
      # The Python APIs: braid and mpi4py alternate batch by batch inside the job.
      pysizes=$(echo "$sizes" | tr ' ' ,)
      mpi_launch "$np" "$MPI_VENV/bin/python" "$here/scripts/mpi4py_compare.py" -o "$out/py_np$np.r$round.json" \
        --sizes "$pysizes" --colls "$(echo "$colls" | tr ' ' ,)" --rounds 1 --first-round $((round - 1)) >"$out/py_np$np.r$round.txt"
    fi
  done
done
python3 - "$out" "$MPI_NAME" <<'PY'
import csv, glob, json, os, re, statistics, sys
out, mpi_name = sys.argv[1], sys.argv[2]
name = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter",
        "broadcast": "bcast", "reduce": "reduce", "alltoall": "alltoall"}
order = list(name)
goal = {"all_reduce": 1.25, "reduce_scatter": 1.25, "reduce": 1.25,
        "all_gather": 1.0, "broadcast": 1.0, "alltoall": 1.0}
# Every round's time per cell, each side.
mpi, braid, reg, py = {}, {}, {}, {}
for f in glob.glob(os.path.join(out, "mpi_np*.r*", "mpi.csv")):
    for row in csv.DictReader(open(f)):
        mpi.setdefault((row["coll"], int(row["nranks"]), int(row["size"])), []).append(float(row["time_us"]))
for f in sorted(glob.glob(os.path.join(out, "braid_*_np*_*.r*.json"))):
    m = re.fullmatch(r"braid_(\w+?)_np(\d+)_(\d+)(\.reg)?\.r\d+\.json", os.path.basename(f))
    if not m:
        continue
    into = reg if m.group(4) else braid
    for r in json.load(open(f))["rows"]:
        if r["size"] != int(m.group(3)):
            continue
        # Like with like: MPI_Bcast works in place, the others out of place.
        side = r["in_place"] if r["collective"] == "broadcast" else r["out_of_place"]
        if side["time_us"]:
            into.setdefault((r["collective"], r["nranks"], r["size"]), []).append(side["time_us"])
for f in glob.glob(os.path.join(out, "py_np*.r*.json")):
    for r in json.load(open(f))["rows"]:
        py.setdefault((r["collective"], r["nranks"], r["size"]), {}).setdefault(r["side"], []).append(r["time_us"])

def size_text(b):
    for unit, m in (("M", 1 << 20), ("K", 1 << 10)):
        if b >= m and b % m == 0:
            return f"{b // m}{unit}"
    return str(b)

def table(title, cells, them):
    """cells: (coll, np, size) -> (braid times, MPI times)."""
    print(f"\n{title}: ratio = {them}'s time / braid's (= busbw braid / {them}); goal: reducing 1.25, moving 1.0")
    print(f"{'collective':15} {'np':>3} {'size':>6} {'braid us':>10} {'mpi us':>10} {'median':>7} {'best':>6} {'goal':>5}")
    miss = []
    for (c, n, size) in sorted(cells, key=lambda k: (order.index(k[0]), k[1], k[2])):
        ts, ms = cells[(c, n, size)]
        med = statistics.median(ms) / statistics.median(ts)
        best = min(ms) / min(ts)
        flag = "MISS" if med < goal[c] else ""
        if flag:
            miss.append(f"{c} np{n} {size_text(size)} {med:.2f}")
        print(f"{c:15} {n:>3} {size_text(size):>6} {statistics.median(ts):>10.2f} {statistics.median(ms):>10.2f}"
              f" {med:>7.2f} {best:>6.2f} {goal[c]:>5.2f} {flag}")
    print(f"below the goal (median): {', '.join(miss) if miss else 'none'}")

rounds = os.environ.get("ROUNDS", "2")
cells = {k: (ts, mpi[(name[k[0]], k[1], k[2])]) for k, ts in braid.items() if (name[k[0]], k[1], k[2]) in mpi}
table(f"Rust API (braid-perf -H 1) vs {mpi_name} (tools/peers/mpi_coll_bench.c)", cells, mpi_name)
if reg:
    cells = {k: (ts, mpi[(name[k[0]], k[1], k[2])]) for k, ts in reg.items() if (name[k[0]], k[1], k[2]) in mpi}
    table(f"braid-perf -R 1 (registered buffers) vs {mpi_name}", cells, mpi_name)
if py:
    cells = {k: (v["braid"], v["mpi"]) for k, v in py.items() if "braid" in v and "mpi" in v}
    table(f"Python API (braid on numpy) vs mpi4py on {mpi_name}", cells, "mpi4py")
print(f"\n{rounds} alternating rounds per side; us: each side's median round; median: ratio of the median rounds, "
      f"best: of the best rounds; out of place, Broadcast in place (as MPI_Bcast)")
print(f"braid-perf on 2 MiB huge pages with BRAID_SINGLE_COPY_MIN_BYTES={os.environ.get('BRAID_SINGLE_COPY_MIN_BYTES')}; "
      f"the MPI with glibc malloc on transparent huge pages")
print("load averages (1, 5, 15 min) as rounds started:", "; ".join(open(os.path.join(out, "load.txt")).read().split("\n")[:-1]),
      "| at the end:", " ".join(open("/proc/loadavg").read().split()[:3]))
PY
[ "$sweep" = 1 ] || exit 0
# Plots: braid's last round against the MPI's, one picture per collective
# and rank count (busbw and latency against size).
for np in $nps; do
  "$perf" import-mpi "$out/mpi_np$np.r$rounds/mpi.csv" --label "$MPI_NAME" -o "$out/mpi_np$np.json" >/dev/null
  for c in $colls; do
    inplace=(); [ "$c" = broadcast ] && inplace=(--in-place)
    # One braid series: the sweep's rows, whose sizes give way to the table's
    # runs of their own.
    r="$out/braid_${c}_np${np}"
    own=(); for size in $sizes; do own+=("${r}_$(cell "$c" "$np" "$size").r$rounds.json"); done
    python3 - "$r.plot.json" "$r.r$rounds.json" "${own[@]}" <<'PY'
import json, sys
sweep, *own = (json.load(open(f)) for f in sys.argv[2:])
mine = {r["size"] for o in own for r in o["rows"]}
sweep["rows"] = sorted([r for r in sweep["rows"] if r["size"] not in mine]
                       + [r for o in own for r in o["rows"]], key=lambda r: r["size"])
json.dump(sweep, open(sys.argv[1], "w"))
PY
    # The moving collectives' -R 1 cells as a third series.
    regs=()
    if [ "$reg" = 1 ] && [ -f "${own[0]%.r$rounds.json}.reg.r$rounds.json" ]; then
      owns=(); for f in "${own[@]}"; do owns+=("${f%.r$rounds.json}.reg.r$rounds.json"); done
      python3 - "$r.reg.plot.json" "${owns[@]}" <<'PY'
import json, sys
runs = [json.load(open(f)) for f in sys.argv[2:]]
out = runs[0]
out["label"] = "braid -R 1"
out["rows"] = sorted((r for o in runs for r in o["rows"]), key=lambda r: r["size"])
json.dump(out, open(sys.argv[1], "w"))
PY
      regs=("$r.reg.plot.json")
    fi
    "$perf" plot "$out/braid_${c}_np${np}.plot.json" "${regs[@]}" "$out/mpi_np$np.json" --coll "$c" "${inplace[@]}" \
      --title "$c, $np ranks, one host" -o "$out/${c}_np$np.png" >/dev/null
  done
done
echo "plots: $out/*_np*.png"
