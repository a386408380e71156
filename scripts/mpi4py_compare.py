"""braid's Python API against mpi4py, both on numpy arrays, in one MPI job.

    mpiexec -n 2 python scripts/mpi4py_compare.py -o rows.json [--sizes 8,1K,64K,1M,8M,64M]
        [--colls all_reduce,all_gather,...] [--rounds 5] [--first-round 0] [--batch 0.05]

Every rank joins MPI_COMM_WORLD (mpi4py) and a braid communicator over the same
ranks (rank 0's braid.UniqueId goes out with an MPI broadcast). For each
collective and size, ROUNDS rounds; in each round one timed batch of braid and
one of MPI on the same arrays, which of the two goes first alternating from
round to round. A batch: an MPI barrier, warm-up calls (2, then as many as
take about WARM seconds by their estimate: the first calls of a process or a
size pay first-use costs, such as a link's first pages, that the 2 alone
left in the estimate, which then timed as few as 3 calls), then ITERS calls
back to back (ITERS from rank 0's estimate over the last warm-up calls,
about BATCH seconds per batch, 3 to 2000); its time is the loop's time per
call averaged over ranks (as nccl-tests and tools/peers/mpi_coll_bench.c).
Out of place, Broadcast in place (as MPI_Bcast); float32 sum; root 0.
Sizes follow nccl-tests: bytes of the whole array per rank (AllGather,
ReduceScatter, AllToAll: the total array, at least 16 bytes per rank). Each side's result is checked once per
collective and size. Rank 0 writes the rows (collective, nranks, size, side,
round, time_us) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import braid

COLLS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall"]
WHOLE = {"all_gather", "reduce_scatter", "alltoall"}


def size_of(text: str) -> int:
    t = text.strip().upper()
    for suf, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suf):
            return int(float(t[:-1]) * m)
    return int(t)


def cell_size(coll: str, size: int, n: int) -> int:
    """The size both sides run: whole-array collectives at least 16 bytes per
    rank and a multiple of 16 * n (braid-perf's rounding)."""
    if coll in WHOLE:
        return max(16 * n, size // (16 * n) * 16 * n)
    return max(4, size // 4 * 4)


class Cell:
    """One collective at one size: the arrays and the two sides' calls."""

    def __init__(self, coll: str, size: int, mpi: MPI.Comm, bc: braid.Communicator):
        n, r = mpi.Get_size(), mpi.Get_rank()
        self.coll, self.n, self.r = coll, n, r
        count = size // 4
        per = count // n if coll in WHOLE else count
        send_count = {"all_gather": per, "reduce_scatter": n * per, "alltoall": n * per}.get(coll, count)
        recv_count = {"all_gather": n * per, "reduce_scatter": per, "alltoall": n * per}.get(coll, count)
        # Small integers: exact float sums in any order.
        self.send = (np.arange(send_count, dtype=np.float32) % 13) + np.float32(r + 1)
        self.recv = np.empty(recv_count, dtype=np.float32)
        self.recv.fill(-7)  # touched: no first-touch page faults inside the timing
        s, v = self.send, self.recv
        if coll == "all_reduce":
            self.b = lambda: bc.all_reduce(s, v)
            self.m = lambda: mpi.Allreduce(s, v, op=MPI.SUM)
        elif coll == "all_gather":
            self.b = lambda: bc.all_gather(s, v)
            self.m = lambda: mpi.Allgather(s, v)
        elif coll == "reduce_scatter":
            self.b = lambda: bc.reduce_scatter(s, v)
            self.m = lambda: mpi.Reduce_scatter_block(s, v, op=MPI.SUM)
        elif coll == "broadcast":
            self.b = lambda: bc.broadcast(s, root=0)
            self.m = lambda: mpi.Bcast(s, root=0)
        elif coll == "reduce":
            self.b = lambda: bc.reduce(s, v, root=0)
            self.m = lambda: mpi.Reduce(s, v, op=MPI.SUM, root=0)
        elif coll == "alltoall":
            self.b = lambda: bc.all_to_all(s, v)
            self.m = lambda: mpi.Alltoall(s, v)
        else:
            raise SystemExit(f"unknown collective {coll}")

    def check(self, call) -> int:
        """Run once on fresh inputs; elements that differ from the reference."""
        n, r, c = self.n, self.r, self.coll
        base = np.arange(len(self.send), dtype=np.float32) % 13
        self.send[:] = base + np.float32(r + 1)
        self.recv.fill(-7)
        call()
        tri = np.float32(n * (n + 1) / 2)
        if c == "all_reduce":
            got, want = self.recv, n * base + tri
        elif c == "reduce":
            if r != 0:
                return 0
            got, want = self.recv, n * base + tri
        elif c == "broadcast":
            got, want = self.send, base + 1
        elif c == "all_gather":
            got = self.recv
            want = np.concatenate([base + np.float32(q + 1) for q in range(n)])
        elif c == "reduce_scatter":
            per = len(self.recv)
            got, want = self.recv, n * base[r * per : (r + 1) * per] + tri
        else:  # alltoall: block r of every rank q
            per = len(self.recv) // n
            got = self.recv
            want = np.concatenate([base[r * per : (r + 1) * per] + np.float32(q + 1) for q in range(n)])
        bad = int(np.count_nonzero(got != want))
        self.send[:] = base + np.float32(r + 1)
        return bad


# Seconds of warm-up calls before each timed batch.
WARM = 0.005


def calls(mpi: MPI.Comm, call, seconds: float, est: float, most: int) -> float:
    """Run as many calls as take about `seconds` by the estimate `est`
    (rank 0's, so every rank runs the same number; at least 3, at most
    `most`), started together after a barrier; the time per call here."""
    k = mpi.bcast(max(3, min(most, int(seconds / max(est, 1e-7)))), root=0)
    mpi.Barrier()
    t0 = time.perf_counter()
    for _ in range(k):
        call()
    return (time.perf_counter() - t0) / k


def batch(mpi: MPI.Comm, call, seconds: float) -> float:
    """Microseconds per call, averaged over ranks."""
    mpi.Barrier()
    t0 = time.perf_counter()
    call()
    call()
    est = calls(mpi, call, WARM, (time.perf_counter() - t0) / 2, 1000)
    dt = calls(mpi, call, seconds, est, 2000)
    return mpi.allreduce(dt, op=MPI.SUM) / mpi.Get_size() * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--sizes", default="8,1K,64K,1M,8M,64M")
    ap.add_argument("--colls", default=",".join(COLLS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--first-round", type=int, default=0, help="number of the first round (its parity picks which side goes first)")
    ap.add_argument("--batch", type=float, default=0.05, help="seconds per timed batch")
    a = ap.parse_args()
    mpi = MPI.COMM_WORLD
    n, r = mpi.Get_size(), mpi.Get_rank()
    uid = mpi.bcast(str(braid.UniqueId.create()) if r == 0 else None, root=0)
    bc = braid.Communicator.init(uid, r, n)
    rows, wrong = [], 0
    for coll in a.colls.split(","):
        for nominal in (size_of(s) for s in a.sizes.split(",")):
            size = cell_size(coll, nominal, n)
            cell = Cell(coll, size, mpi, bc)
            sides = {"braid": cell.b, "mpi": cell.m}
            for side, call in sides.items():
                bad = mpi.allreduce(cell.check(call), op=MPI.SUM)
                if bad:
                    print(f"{coll} {size} B on {n} ranks: {side} got {bad} wrong elements", file=sys.stderr)
                    wrong += bad
            for rnd in range(a.first_round, a.first_round + a.rounds):
                order = ["braid", "mpi"] if rnd % 2 == 0 else ["mpi", "braid"]
                for side in order:
                    us = batch(mpi, sides[side], a.batch)
                    rows.append(dict(collective=coll, nranks=n, size=size, side=side, round=rnd, time_us=us))
            if r == 0:
                med = {
                    s: sorted(x["time_us"] for x in rows if x["collective"] == coll and x["size"] == size and x["side"] == s)
                    for s in sides
                }
                b, m = (v[len(v) // 2] for v in (med["braid"], med["mpi"]))
                print(f"{coll:15} np {n} {size:>9} braid {b:10.2f} us  mpi {m:10.2f} us  x {m / b:5.2f}", flush=True)
            del cell
    bc.close()
    if r == 0:
        meta = dict(mpi=MPI.Get_library_version().strip(), mpi4py=__import__("mpi4py").__version__,
                    braid=getattr(braid, "__version__", "?"), rounds=a.rounds, batch_s=a.batch,
                    env={k: v for k, v in os.environ.items() if k.startswith("BRAID_") or k == "GLIBC_TUNABLES"})
        with open(a.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f)
    if wrong:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
